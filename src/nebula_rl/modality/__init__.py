"""What differs between the two kinds of model nebula-rl trains, behind one seam: language and
vision-language models (`text`) and world models (`world`, `policy.is_diffusers`).

The roles ask the job's :class:`Modality` (:func:`for_config`) for the part that differs (the
single-process run, the launcher's checks, a replica's work, the controller's rows, what
`nebula-rl check` reports) instead of testing `policy.is_diffusers`; this module is the one
place that tests it. Importing it imports no torch: each modality loads its code when asked.
"""

from __future__ import annotations

from nebula_rl.config import Config
from nebula_rl.modality.base import Modality, Report

__all__ = ["Modality", "Report", "for_config"]


def for_config(cfg: Config) -> Modality:
    """The modality of the model `cfg` trains."""
    if cfg.policy.is_diffusers:
        from nebula_rl.modality.world import World

        return World()
    from nebula_rl.modality.text import Text

    return Text()
