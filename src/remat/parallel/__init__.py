"""remat on several ranks: one module per kind of parallelism, and the rank plumbing.

- :mod:`.ranks`: this process's rank of a ``torchrun`` job (``init_from_env``,
  ``RankInfo``), its share of a batch (``shard_batch``), rank 0's artifact on every rank
  (``rank_zeros``), a flag agreed by every rank (``on_every_rank``);
- :mod:`.data_parallel`: DDP and FSDP2;
- :mod:`.gathers`: the all-gathers and reduce-scatters a data-parallel step makes,
  counted and timed;
- :mod:`.tensor`: tensor and sequence parallelism (DTensor);
- :mod:`.pipeline`: ``torch.distributed.pipelining`` stages.

The shared interface
--------------------
Each kind offers the same three calls, under its own names where the kind's set-up
differs. The planning itself is torch-free and lives in :mod:`remat.core`: these
modules measure what it needs and put its plans on the ranks.

DDP and FSDP2 (:mod:`.data_parallel`)
    wrap: ``shard_stages`` before the plan, ``wrap_ddp`` after it
    (``DataParallelRank.shard_before_plan``, ``.wrap_after_plan``);
    problem: ``rank_problem``, to ``core.transforms.per_rank_problem``, its times from
    ``profile_as_run`` (the wrapped model profiled);
    measure: ``rank_step_memory`` / ``rank_step_peak`` (allocator events by address and
    thread), ``plan_rank_memory`` (wrap, apply and measure in one call).
tensor and sequence (:mod:`.tensor`)
    wrap: ``agreed_plan`` (every rank of a mesh rebuilds the same stages), then
    ``remat.apply`` on the parallelized model;
    problem: ``stage_comms``, each stage's collectives and what its rebuild repeats,
    recorded in the profile (``core.collectives`` prices them for any plan);
    measure: ``count_collectives``.
pipeline (:mod:`.pipeline`)
    wrap: ``apply_to_stage``;
    problem: ``profile_part`` and ``schedule_buffers``, to ``core.pipeline``
    (``split_stage`` and ``schedule_orders`` to ``core.zero_bubble``);
    measure: ``rank_step_peak``.

A new kind (context parallelism, say) is a module here offering the same three calls,
its torch-free half (how its rank's problem differs from one process's) in
``remat.core``; docs/architecture.md, "Where to add things", says which tests.

:mod:`.tensor` sits in a lower layer than the rest of the package: ``remat.profile``
records a tensor-parallel model's collectives per stage with it (tests/test_architecture.py).
"""
