"""Environment values keep the text the user typed.

``job.env`` and ``cluster.env`` are ``dict[str, str]``, but Hydra parses an override's value
before OmegaConf stores it: ``+job.env.X=false`` arrives as the bool False and is stored as
``str(False)``, "False"; ``1.50`` becomes "1.5" and ``1e3`` "1000.0". A program then reads a
value the user never wrote (``X=False`` in the batch script, the frozen config and every rank's
environment). Quoting the value makes Hydra keep it as the string it was typed as; only values
Hydra could read as a bool or a number are rewritten, everything else is passed on verbatim.
"""

from __future__ import annotations

import re

# +key / ++key / key, one env entry, and a value of only the characters a bool, int or float
# literal can hold (so it has no quote or backslash to escape inside the quotes).
_ENV_OVERRIDE = re.compile(r"(\+{0,2})((?:job|cluster)\.env\.[A-Za-z_][A-Za-z0-9_]*)=([A-Za-z0-9_.+-]+)")


def keep_env_text(overrides: list[str]) -> list[str]:
    """``overrides`` with every ``job.env.X=<literal>`` / ``cluster.env.X=<literal>`` quoted."""
    out = []
    for o in overrides:
        m = _ENV_OVERRIDE.fullmatch(o)
        out.append(f"{m[1]}{m[2]}='{m[3]}'" if m else o)
    return out
