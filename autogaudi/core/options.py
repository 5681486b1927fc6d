"""One typed set of options shared by the launcher, ``enable(**kwargs)`` and the environment.

Each option is declared once below; the CLI flags, the ``AUTOGAUDI_*`` environment variables, the
``--help`` text and the docs are all derived from that declaration, so they cannot drift apart.
Precedence is kwargs > CLI > environment > defaults: the launcher writes the CLI flags into the
environment (so child processes such as torchrun workers inherit them), and ``enable(**kwargs)``
overlays its keywords on whatever the environment says.

This module is imported by the ``AUTOGAUDI=1`` bootstrap of every Python process, so it avoids
``typing``/``dataclasses`` and imports nothing heavy.
"""

from __future__ import annotations

import os

from autogaudi.core.errors import OptionsError
from autogaudi.core.reasons import Reason
from autogaudi.core.registry import OPT_IN_UNITS, SWITCHED_ON_BY, UNIT_NAMES

DEVICES = ("auto", "hpu", "cuda", "cpu")
SDPA_RECOMPUTE = ("auto", "on", "off")
LAST_BATCH = ("repeat", "drop")
PRECISIONS = ("off", "auto", "bf16", "fp16", "tf32")
# the units that choose by timing the run's own steps, and change its numbers: only where asked for
TRIAL_UNITS = ("graph_capture", "channels_last", "fused_optimizer", "hpu_mode")
ENV_PREFIX = "AUTOGAUDI_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
GIB = 1024**3  # --memory-limit's unit


def _choices(name: str, valid) -> str:
    return f"valid choices for {name}: {', '.join(valid)}"


def parse_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise OptionsError(f"{name}={value!r} is not a boolean; {_choices(name, ('1', '0', 'true', 'false'))}")


def _choice(valid):
    def parse(name: str, value) -> str:
        text = str(value).strip().lower()
        if text not in valid:
            raise OptionsError(f"{name}={value!r} is not one of them; {_choices(name, valid)}")
        return text

    return parse


def _units_of(valid):
    def parse(name: str, value) -> tuple:
        if value is None:
            return ()
        items = value.split(",") if isinstance(value, str) else list(value)
        units = tuple(dict.fromkeys(str(item).strip() for item in items if str(item).strip()))
        unknown = [unit for unit in units if unit not in valid]
        if unknown:
            raise OptionsError(f"{name}: unknown or unsuitable unit(s) {', '.join(unknown)}; {_choices(name, valid)}")
        return units

    return parse


_parse_units = _units_of(UNIT_NAMES)


def _parse_optional_units(name: str, value):
    return None if value is None or value == "" else _parse_units(name, value)


def _parse_count(name: str, value) -> int:
    try:
        number = -1 if isinstance(value, bool) else int(value if isinstance(value, int) else str(value).strip())
    except ValueError:
        number = -1
    if number < 0:
        raise OptionsError(f"{name}={value!r} must be a whole number >= 0")
    return number


def _parse_gigabytes(name: str, value):
    if value is None or str(value).strip() == "":
        return None
    try:
        number = float(value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value).strip())
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf") or int(number * GIB) < 1:  # a budget of no byte is none at all
        raise OptionsError(f"{name}={value!r} must be a number of gigabytes, 1e-09 (a byte) or more")
    return number


def _parse_path(name: str, value):
    if value is None or str(value).strip() == "":
        return None
    return os.fspath(value)


class Option:
    """One setting: its name, default, parser and help line; flag and env names derive from it."""

    __slots__ = ("name", "default", "parse", "help", "metavar")

    def __init__(self, name, default, parse, help, metavar=None):
        self.name = name
        self.default = default
        self.parse = parse
        self.help = help
        self.metavar = metavar

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return self.parse is parse_bool

    def to_env(self, value) -> str:
        """The environment spelling of a parsed value (inverse of ``parse``)."""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, tuple):
            return ",".join(value)
        return "" if value is None else str(value)


OPTIONS: tuple = (
    Option(
        "device",
        "auto",
        _choice(DEVICES),
        "backend to optimize for: auto detects hpu, then cuda, then cpu",
        "{" + ",".join(DEVICES) + "}",
    ),
    Option("disable", (), _parse_units, "comma-separated optimization units to switch off", "UNIT,..."),
    Option(
        "only",
        None,
        _parse_optional_units,
        "comma-separated optimization units to consider, all others switched off (default: all)",
        "UNIT,...",
    ),
    Option(
        "force",
        (),
        _parse_units,
        "comma-separated units to switch on where they are off by default (opt-in: "
        + ", ".join(OPT_IN_UNITS)
        + "), or to apply without measuring first (graph_capture: even if not "
        "host-bound; graph_capture, channels_last: without a trial; loader_workers: also measure and "
        "raise a num_workers the script chose)",
        "UNIT,...",
    ),
    Option(
        "trial",
        (),
        _units_of(TRIAL_UNITS),
        "comma-separated units to A/B-test in the run (none is by default: each changes the run's numbers, "
        "and a choice timed on the run's own steps moves with the machine's load), even where the step profile "
        "says they would not help or could not pay back (graph_capture: not host-bound, or the run too short; "
        "channels_last: input-bound; fused_optimizer: the fused update timed on copies where the host waits for "
        "each op, as on CPU; hpu_mode: lazy and eager measured one run each, later runs set the faster); kept "
        "only if measured faster",
        "UNIT,...",
    ),
    Option(
        "sdpa_recompute",
        "auto",
        _choice(SDPA_RECOMPUTE),
        "HPU FusedSDPA recompute mode (saves memory, costs time): auto leaves the bridge's default",
        "{" + ",".join(SDPA_RECOMPUTE) + "}",
    ),
    Option(
        "last_batch",
        "repeat",
        _choice(LAST_BATCH),
        "static_last_batch policy: repeat samples from the epoch's start, or drop the short batch",
        "{" + ",".join(LAST_BATCH) + "}",
    ),
    Option(
        "precision",
        "off",
        _choice(PRECISIONS),
        "mixed_precision: bf16 autocast of the training model's forward, fp16 autocast with loss scaling, tf32 CUDA "
        "matmuls, or auto (bf16 where supported, else fp16 on CUDA, kept where a trial measures it faster); each "
        "used only after matching float32 on the run's own steps, and "
        "switched back on a NaN/Inf or spiking loss (off by default: it changes numerics)",
        "{" + ",".join(PRECISIONS) + "}",
    ),
    Option(
        "memory_limit",
        None,
        _parse_gigabytes,
        "run as if the device had this much memory (GiB, 1e-09 or more): the first training step's peak is measured "
        "and activation_checkpointing keeps the steps after it under the limit; on CUDA also "
        "enforced with torch.cuda.set_per_process_memory_fraction",
        "GB",
    ),
    Option(
        "report",
        None,
        _parse_path,
        "also write the exit report to this path, a regular file or a new name (a device, FIFO, socket or - is "
        "refused before the script starts): a page with the step-time chart where it ends in .html, else JSON",
        "PATH",
    ),
    Option(
        "verbose",
        False,
        parse_bool,
        "print every unit's row, the trials and the advice in full after the short exit report "
        "(the JSON report always has them)",
    ),
    Option(
        "log_every", 0, _parse_count, "throughput_meter prints a progress line every N optimizer steps (0: never)", "N"
    ),
    Option("warmup_steps", 3, _parse_count, "steps excluded from the timing figures (compilation, caches)", "N"),
    Option(
        "no_trials",
        False,
        parse_bool,
        "do not A/B-test the units whose benefit depends on the workload (graph_capture, channels_last) "
        "inside the run; apply them by their static rule instead",
    ),
    Option(
        "exact",
        False,
        parse_bool,
        "only the units that leave the run's numbers bitwise identical to plain PyTorch on this machine "
        "(every loss, parameter, gradient and random draw); the others are off, each with the reason "
        "code not_exact (docs/numerics.md)",
    ),
    Option(
        "exact_random",
        False,
        parse_bool,
        "graph_capture compiles with inductor's fallback_random: dropout draws the same masks as "
        "eager PyTorch, though compiled kernels still round otherwise (--exact for identical numbers; "
        "slower: measured 0.80x of the default compiled speed on a 2-core CPU); no effect on HPU",
    ),
    Option("quiet", False, parse_bool, "do not print the exit report (the JSON report is still written)"),
    Option(
        "cache_dir",
        None,
        _parse_path,
        "where decisions are remembered between runs and compile caches are kept (default: "
        "$XDG_CACHE_HOME/autogaudi where that is an absolute path, else ~/.cache/autogaudi); see python -m "
        "autogaudi cache list",
        "PATH",
    ),
    Option(
        "no_cache",
        False,
        parse_bool,
        "neither read nor write the cache folder: every decision is measured again, compile caches stay torch's",
    ),
    Option(
        "cache_max_mb",
        2048,
        _parse_count,
        "size limit of the cache folder; past it the files modified longest ago are deleted first",
        "MB",
    ),
    Option(
        "cache_trust_shared",
        False,
        parse_bool,
        "use a cache folder owned by another user or writable by others (by default nothing is read "
        "from it); the risk: anyone who can write that folder can make your runs execute their code",
    ),
)
OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}


class Options:
    """Resolved, validated, immutable settings for one process."""

    __slots__ = tuple(OPTIONS_BY_NAME)

    def __init__(self, **values):
        unknown = sorted(set(values) - set(OPTIONS_BY_NAME))
        if unknown:
            raise OptionsError(f"unknown option(s) {', '.join(unknown)}; {_choices('options', OPTIONS_BY_NAME)}")
        for option in OPTIONS:
            value = values.get(option.name, option.default)
            object.__setattr__(self, option.name, option.parse(option.name, value))
        if self.trial and self.no_trials:
            raise OptionsError(f"trial={','.join(self.trial)} asks for trials that no_trials rules out; choose one")

    def __setattr__(self, name, value):
        raise AttributeError("Options are immutable; use replace()")

    @classmethod
    def from_env(cls, environ=None) -> Options:
        environ = os.environ if environ is None else environ
        values = {}
        for option in OPTIONS:
            if option.env in environ:
                try:
                    values[option.name] = option.parse(option.env, environ[option.env])
                except OptionsError as error:
                    raise OptionsError(f"environment: {error}") from None
        return cls(**values)

    def replace(self, **changes) -> Options:
        return Options(**{**self.as_dict(), **changes})

    def as_dict(self) -> dict:
        return {option.name: getattr(self, option.name) for option in OPTIONS}

    def env_overrides(self, names) -> dict:
        """Environment variables that carry the named options to child processes."""
        return {OPTIONS_BY_NAME[name].env: OPTIONS_BY_NAME[name].to_env(getattr(self, name)) for name in names}

    def unit_switched_off(self, unit: str):
        """Why the options switch ``unit`` off, or None when they leave it on."""
        if unit in self.disable:
            return Reason("switched_off", flag=OPTIONS_BY_NAME["disable"].flag, env=OPTIONS_BY_NAME["disable"].env)
        if self.only is not None and unit not in self.only:
            return Reason("not_listed", flag=OPTIONS_BY_NAME["only"].flag, env=OPTIONS_BY_NAME["only"].env)
        if unit in OPT_IN_UNITS and unit not in self.force:
            return Reason("opt_in", flag=OPTIONS_BY_NAME["force"].flag, unit=unit)
        if unit in SWITCHED_ON_BY:
            name, why = SWITCHED_ON_BY[unit]
            if getattr(self, name) == "off":
                option = OPTIONS_BY_NAME[name]
                return Reason("off_by_default", why=why, flag=option.flag, choices=option.metavar)
        return None

    def __eq__(self, other):
        return isinstance(other, Options) and self.as_dict() == other.as_dict()

    __hash__ = None

    def __repr__(self):
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"
