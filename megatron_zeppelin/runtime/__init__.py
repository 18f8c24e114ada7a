"""Runtime over torch.distributed: ring attention engine, remapping layer, routed P2P."""
