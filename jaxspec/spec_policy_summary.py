"""What the auto policy (spec_policy.py) learned and did: the /server_info endpoint's and the
benches' view of it."""
from __future__ import annotations

import math

import numpy as np


def summary(policy) -> dict:
    """What the policy learned and did: per tree its accept length and the histogram of tokens
    a row-step emitted, per bucket the costs seen and how many calls took each tree."""
    by_bucket = lambda d: {str(r): {k: v for (r2, k), v in sorted(d.items()) if r2 == r}
                           for r in sorted({r for r, _ in d})}
    accept = {t.label if k is None else f"{t.label} @{k}": round(e, 3) for (t, k), e in policy.emitted.items()}
    linked = {t: d for t in policy.links.chain if policy.level is not None and (d := policy.links.diff(t)) is not None}
    expected = {t.label: round(e, 3) for t in policy.seen if (e := policy.expected(t)) is not None}
    return dict(accept_length=accept, expected=expected,
                linked_expected={t.label: round(1 + min(math.exp(policy.level + d), t.steps), 3) for t, d in linked.items()},
                accept_histogram={t.label: dict(sorted(c.items())) for t, c in policy.accepts.items()},
                observed_ms=by_bucket({k: round(ms / steps, 3) for k, (ms, steps) in policy.observed.items()}),
                recent_ms=by_bucket({k: [round(float(q), 3) for q in np.percentile(v, (50, 90, 100))]
                                     for k, v in policy.recent.items()}),
                launch={str(r): dict(ms=round(ms, 3), unchained=round(policy.unchained.get(r, 0.0), 3))
                        for r, ms in sorted(policy.launch_ms.items())},
                chosen=by_bucket(policy.chosen),
                why=by_bucket(policy.why))  # bucket -> "shape: reason" -> calls, as chosen (closed_wave.py's overrules apart)
