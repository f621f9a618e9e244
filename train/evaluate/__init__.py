"""Evaluation: what a drafter will do when served, measured offline and by decoding.

The room sits between the training job and the serving contract: the job (train/) calls it,
it calls the contract (`eyas.models.serving`) and the network, and of train/ it reads only the
schema (`train.config`, for its defaults) and `train.plots`. tests/test_layout.py holds it to that.

    offline        exact τ of the eval split: the decoder walk and every chain start
    sampled        the same at temperature T > 0 (expected acceptance, `models.expected_tau`)
    specdec        eyas's own speculative decoder (the drafter loaded as vLLM loads it)
    specdec_summary  its per-prompt rounds as the run's τ, acceptance per position and context
    sampling       the speculative-sampling rule (accept with min(1, p/q), else resample)
    pool           decoding in worker processes, each with its own target and drafter
    decode_sweep   speedup against K from eyas's decoder
    engine         a real engine serving an export (vLLM's CPU build) and its counters
    engine_sweep   speedup against K and concurrency from the engine
    cli            `eyas evaluate`
"""
