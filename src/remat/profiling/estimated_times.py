"""A profile's times replaced by the roofline's estimates for a device (``remat.core.roofline``).

Per stage: forward and backward from its counted ops, the rebuild a forward again
(and its saved tensors packed: ``WorkTable.rebuild``), each
selective option's extra the forward less the ops it saves; outside the chain the pre-
and post-chain and the optimizer step; the step their sum. Under tensor parallelism
(stages with ``comms``, a device with a link bandwidth, ``ranks`` given) the stage's
collectives are priced at the link (``remat.core.collectives.collective_seconds``,
nothing overlapped): its forward's in its forward, its rebuild and its backward (each
collective's backward moves the same bytes: an all-gather's is a reduce-scatter), a
one-stage region's repeats in each selective option's replay but
``save-collectives``'. The byte figures are left as they are. Used for fake
profiles with a ``--device`` (whose own times are only the fake run's dispatch) and
to check the estimate against measured times (benchmarks).
"""

from __future__ import annotations

from dataclasses import replace

from remat.core.collectives import collective_seconds
from remat.core.devices import Device
from remat.core.profile_format import Profile
from remat.core.roofline import WorkTable

__all__ = ["with_estimated_times"]


def with_estimated_times(profile: Profile, work: WorkTable, device: Device,
                         ranks: int | None = None) -> Profile:
    """``profile`` with every time the roofline's for ``device`` (its collectives priced
    over ``ranks`` ranks where the stages record them: module docstring)."""
    stages = []
    link = device.link_bytes_per_s
    for s in profile.stages:
        forward_c = replay_c = 0.0
        if s.comms is not None and link is not None and ranks is not None:
            forward_c = collective_seconds(s.comms.forward, link, ranks)
            replay_c = collective_seconds(s.comms.rebuild_last, link, ranks)
        fwd = work.forward(s.name, device) + forward_c
        stages.append(replace(
            s, fwd_s=fwd, bwd_s=work.backward(s.name, device) + forward_c,
            rebuild_s=work.rebuild(s.name, device) + forward_c,
            extra_bwd_s={o: work.replay(s.name, o, device)
                         + (0.0 if o == "selective:save-collectives" else replay_c)
                         for o in s.extra_bwd_s},
            time_spread={},
        ))
    outside = work.outside(device)
    step = outside + sum(s.fwd_s + s.bwd_s for s in stages)
    return replace(profile, stages=tuple(stages), outside_chain_s=outside, step_s=step,
                   timing_noise=None, timed_rounds=None, region_link_s=None)
