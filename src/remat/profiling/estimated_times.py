"""A profile's times replaced by the roofline's estimates for a device (``remat.core.roofline``).

Per stage: forward and backward from its counted ops, the rebuild a forward again, each
selective option's extra the forward less the ops it saves; outside the chain the pre-
and post-chain and the optimizer step; the step their sum. The byte figures are left as
they are. Used for fake profiles with a ``--device`` (whose own times are only the fake
run's dispatch) and to check the estimate against measured times (benchmarks).
"""

from __future__ import annotations

from dataclasses import replace

from remat.core.devices import Device
from remat.core.profile_format import Profile
from remat.core.roofline import WorkTable

__all__ = ["with_estimated_times"]


def with_estimated_times(profile: Profile, work: WorkTable, device: Device) -> Profile:
    """``profile`` with every time the roofline's for ``device``."""
    stages = []
    for s in profile.stages:
        fwd = work.forward(s.name, device)
        stages.append(replace(
            s, fwd_s=fwd, bwd_s=work.backward(s.name, device), rebuild_s=fwd,
            extra_bwd_s={o: work.replay(s.name, o, device) for o in s.extra_bwd_s},
            time_spread={},
        ))
    outside = work.outside(device)
    step = outside + sum(s.fwd_s + s.bwd_s for s in stages)
    return replace(profile, stages=tuple(stages), outside_chain_s=outside, step_s=step,
                   timing_noise=None, timed_rounds=None, region_link_s=None)
