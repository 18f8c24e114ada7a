"""megatron-zeppelin: the Zeppelin context-parallel mode for Megatron-Core.

Layers, imported one way only (a layer may import the ones above it, never below); everything
down to ``sim/`` imports no torch (``docs/architecture.md`` has the picture):

    errors, env, segments, plan, plan_checks   the contract (Plan) and the environment
    options, config, parallel, schedule         settings, YAML, pool layout, engine schedule facts
    cost_model, estimate                        FLOPs, bytes, times; the step estimate
    planner/                                    strategies (zeppelin portfolio, peers), planner
                                                process, C++ twin switch
    router/                                     NIC-aware routing schedule (Python + C++ twin)
    sim/                                        cluster simulator, workloads, reports
    runtime/                                    torch.distributed: engine, kernels, rings, remap
    megatron/loop/                              our training loop (scripts/pretrain_gpt.py)
    megatron/lm/                                Megatron-LM's pretrain_gpt.py glue (patches/)
    megatron/common/                            Megatron-Core pieces both use: attention, spec, data
    bench/                                      all measurement: benchmarks, calibration, fidelity
    cli                                         the ``zeppelin`` command
"""
__version__ = "0.1.0"
