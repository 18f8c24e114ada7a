"""megatron-zeppelin: the Zeppelin context-parallel mode for Megatron-Core.

Layers, imported one way only (a layer may import the ones above it, never below):

    env, plan, plan_checks, config      the contract and what a user edits
    cost_model                          FLOPs, bytes, times, crossover lengths
    planner/                            zeppelin partitioner, baselines, linear layout
    router/                             NIC-aware routing schedule (Python + C++ twin)
    sim/                                cluster simulator, workloads, reports (no torch)
    runtime/                            torch.distributed: rings, attention engine, remap
    megatron/                           Megatron-Core integration (spec, data hook, args)
    bench/                              all measurement: benchmarks, calibration, fidelity
    cli                                 the ``zeppelin`` command
"""
__version__ = "0.1.0"
