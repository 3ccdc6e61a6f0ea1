"""Checks of preference optimisation (``data.format=preference``, ``zerotron dpo``), each a one-line
:class:`~zerotron.config_load.ConfigError` before anything is spawned; :func:`zerotron.config_check.validate`
calls them."""

from __future__ import annotations

import math

from zerotron.config import Config, PreferenceConfig
from zerotron.config_load import ConfigError


def check_preference(cfg: Config) -> None:
    """The preference settings' ranges, packed rows (not built), and preference keys set for another
    kind of data (refused rather than ignored)."""
    pref, d = cfg.preference, cfg.data
    if d.format != "preference":
        defaults = PreferenceConfig()
        for key in ("loss", "beta", "simpo_gamma"):
            if getattr(pref, key) != getattr(defaults, key):
                raise ConfigError(
                    f"preference.{key}={getattr(pref, key)} sets the preference loss, and data.format={d.format}: "
                    "train on preference pairs (data.format=preference, or zerotron dpo), or leave it out"
                )
        return
    if not (math.isfinite(pref.beta) and pref.beta > 0) or not math.isfinite(pref.simpo_gamma):
        raise ConfigError(
            f"preference.beta={pref.beta} must be a positive number and preference.simpo_gamma="
            f"{pref.simpo_gamma} a finite one (TRL's defaults: 0.1 and 0.5)"
        )
    if d.loss_on != "assistant":
        raise ConfigError(
            f"data.loss_on={d.loss_on} chooses supervised tokens; a preference pair's loss counts each "
            "answer's tokens: leave data.loss_on out"
        )
    if d.packing:
        raise ConfigError(
            "data.format=preference is not built with packed rows (data.packing=true): each answer is its "
            "own row; set data.packing=false"
        )
