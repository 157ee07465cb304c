"""The schema of a run's sidecar ``OUTFILE.json`` and the one migration from the schema before it.

Version 2 (:data:`SIDECAR_SCHEMA`) records ``"schema": 2`` and every setting, defaults included. Version 1 (every
sidecar without a ``schema`` entry) left a setting out where it was at its default. :func:`current_settings` reads such
a file as version 2 by writing in the defaults it left out, before a resume or a merge compares it with anything. A
default wrong here would let a resume append rows of another setting to a file, so each entry of
:data:`VERSION_1_DEFAULTS` is the value the code that wrote version 1 ran with when it left the key out.
"""
from __future__ import annotations

from typing import Any

from ..sampling.engine import PHILOX_STREAM

SIDECAR_SCHEMA = 2

#: What a version-1 sidecar of each task kind left out at its default. noise_stream: written only for other
#: generators than the Philox kernels. certify: protocol, its lipschitz_factor and certificate (false for an estimate)
#: only off "sound"; precision off float32; gamma_batch off classic bisection; bn_folded only as false (an f_R
#: sampled with a BatchNorm unfolded); sequential only as true (with its radii and budget). certify-margin draws no
#: noise and recorded nothing optional of its own.
VERSION_1_DEFAULTS: dict[str, dict[str, Any]] = {
    "certify": {"protocol": "sound", "lipschitz_factor": 1.0, "certificate": True, "precision": "float32",
                "gamma_batch": 2, "bn_folded": True, "sequential": False, "noise_stream": PHILOX_STREAM},
    "predict": {"precision": "float32", "bn_folded": True, "noise_stream": PHILOX_STREAM},
    "attack": {"precision": "float32", "noise_stream": PHILOX_STREAM},
    "certify-margin": {},
}
#: Left out of a version-1 sidecar of a run from a checkpoint (one with ``checkpoint_digest``) when it was read as
#: a splitz_fast checkpoint.
VERSION_1_CHECKPOINT_DEFAULTS = {"checkpoint_format": "splitz"}
#: ``input_normalization`` is written with ``checkpoint_format`` ``"macer"`` only, which has no default (MACER's files
#: do not record it) and which no version-1 sidecar can hold (that format came after schema 2): nothing to fill in.

#: How margin runs were recorded before the run tasks (up to a9ddd72): as CERTIFY runs with placeholder sampling
#: settings. Their rows are those of today's margin runs.
_MARGIN_AS_CERTIFY = {"kind": "certify", "n0": 1, "n": 1, "alpha": 0.5, "sigma": None}


def current_settings(recorded: dict[str, Any], name: str) -> dict[str, Any]:
    """The settings of a sidecar (``recorded``, read from the file called ``name``) as this version writes them:
    version 2 as it is, version 1 with the defaults it left out (:data:`VERSION_1_DEFAULTS`). A sidecar of a newer
    schema is refused with ``ValueError``, in words that follow the file's name: the settings it records may mean
    something this version cannot tell."""
    schema = recorded.get("schema", 1)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise ValueError(f"{name} records sidecar schema {schema!r}, which no splitz_fast writes; restore it or start "
                         "a new OUTFILE")
    if schema > SIDECAR_SCHEMA:
        raise ValueError(f"{name} has sidecar schema {schema}, newer than this splitz_fast reads ({SIDECAR_SCHEMA}); "
                         "upgrade splitz_fast or start a new OUTFILE")
    if schema == SIDECAR_SCHEMA:
        return recorded
    settings = _margin_recorded_as_margin(recorded)
    defaults = dict(VERSION_1_DEFAULTS.get(settings.get("kind"), {}))
    if "checkpoint_digest" in settings:
        defaults.update(VERSION_1_CHECKPOINT_DEFAULTS)
    return {**defaults, **settings, "schema": SIDECAR_SCHEMA}


def _margin_recorded_as_margin(recorded: dict[str, Any]) -> dict[str, Any]:
    """A margin run recorded as a CERTIFY run with placeholder sampling settings, recorded as a margin run (others as
    they are): only with every placeholder in place, so that a real CERTIFY run is never read as one."""
    missing = object()
    if recorded.get("certifier") == "margin" and all(
            recorded.get(key, missing) == value for key, value in _MARGIN_AS_CERTIFY.items()):
        kept = {key: value for key, value in recorded.items() if key not in _MARGIN_AS_CERTIFY}
        return {**kept, "kind": "certify-margin"}
    return recorded


__all__ = ["SIDECAR_SCHEMA", "VERSION_1_DEFAULTS", "VERSION_1_CHECKPOINT_DEFAULTS", "current_settings"]
