"""Probe specs: the registry of probe constructors, spec strings (``"xgrpo+sgt:lam=0.3"``, ``"none|sgt"``) built
with the run's options, probes by import path (``"my_pkg.probes:hedge:lam=0.2+sgt"``: a factory
``fn(options: RunOptions, **kwargs) -> Probe``, as reward functions load), and ``switch`` (one compiled update
over several chains)."""

from __future__ import annotations

import ast
import inspect
from typing import Any, Callable, Optional, Sequence, Union

import jax.numpy as jnp

from mrl_jax import grpo
from mrl_jax.configs import import_attribute, one_line
from mrl_jax.probes._kinds import prp, replay, sgt, xgrpo
from mrl_jax.probes._probe import Probe, RunOptions, chain, none
from mrl_jax.rows import PER_ROW

REGISTRY: dict[str, Callable[..., Probe]] = {"none": none, "xgrpo": xgrpo, "prp": prp, "sgt": sgt, "replay": replay}


def _split_spec(part: str, *, strict: bool) -> tuple[str, dict[str, Any]]:
    """``"sgt:lam=0.3,tau=1.0"`` -> ``("sgt", {"lam": 0.3, "tau": 1.0})`` (values as Python literals, else
    strings); ``strict``: an option without ``=`` is an error."""
    name, _, args = part.strip().partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        k, eq, v = item.partition("=")
        if strict and not eq:
            raise ValueError(f"probe option {item!r} in {part!r} must be key=value")
        try:
            kwargs[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            kwargs[k.strip()] = v.strip()
    return name.strip().lower(), kwargs


def import_path(part: str) -> Optional[tuple[str, str, str]]:
    """``"pkg.mod:fn:lam=0.2"`` -> ``("pkg.mod", "fn", "lam=0.2")`` when ``part`` names a probe factory by
    import path (a dotted module, or a second field that is a name rather than ``key=value``), else None."""
    head, sep, rest = part.strip().partition(":")
    if head.strip().lower() in REGISTRY:
        return None
    attr, _, opts = rest.partition(":")
    if "." in head or (sep and attr.strip() and "=" not in attr):
        return head.strip(), attr.strip(), opts
    return None


def load_factory(module: str, attr: str, spec: str) -> Callable[..., Probe]:
    """The callable ``module:attr`` (dotted attributes allowed); ValueError (one line, naming ``spec``) when it
    does not import, is missing or is not callable."""
    if not module or not attr:
        raise ValueError(f"probe {spec!r} is not 'package.module:factory[:key=value,...]'")
    obj = import_attribute(module, attr, f"probe {spec!r}")
    if not callable(obj):
        raise ValueError(f"probe {spec!r}: {module}:{attr} is a {type(obj).__name__}, not a probe factory "
                         "fn(options, **kwargs) -> Probe")
    return obj


def _external(spec: str, path: tuple[str, str, str], options: Optional[RunOptions]) -> Probe:
    """A researcher's probe: ``factory(options=<the run's RunOptions>, **options from the spec)``; ValueError (one
    line naming ``spec``) whatever the factory raises."""
    module, attr, opts = path
    _, kwargs = _split_spec("x:" + opts, strict=True)
    factory = load_factory(module, attr, spec.strip())
    try:
        probe = factory(options=RunOptions() if options is None else options, **kwargs)
    except TypeError as e:
        try:
            sig = f"{attr}{inspect.signature(factory)}"
        except (TypeError, ValueError):
            sig = attr
        raise ValueError(f"bad options for probe {spec.strip()!r} ({one_line(e)}); the factory is {sig}") from None
    except Exception as e:  # noqa: BLE001 -- whatever a researcher's factory raises is a bad probe, not a crash
        raise ValueError(f"probe {spec.strip()!r}: the factory {module}:{attr} raised {one_line(e)}; fix the factory "
                         "or its options") from None
    if not isinstance(probe, Probe):
        raise ValueError(f"probe {spec.strip()!r}: {module}:{attr} returned a {type(probe).__name__}, not a "
                         "mrl_jax.probes.Probe (return Probe(name, extend, advantages, loss_terms, ..., options=options))")
    return probe


def _parse_one(spec: str, options: Optional[RunOptions]) -> Probe:
    path = import_path(spec)
    if path is not None:
        return _external(spec, path, options)
    name, kwargs = _split_spec(spec, strict=True)
    if name not in REGISTRY:
        raise ValueError(f"unknown probe {name!r}; known: {sorted(REGISTRY)} or a factory by import path "
                         "'package.module:factory[:key=value]' (combine with '+', options as 'sgt:lam=0.3,tau=1.0')")
    try:
        return REGISTRY[name](options=options, **kwargs)
    except TypeError as e:
        raise ValueError(f"bad options for probe {name!r}: {e}") from None


def make_probe(spec: Union[str, Probe, Sequence[Union[str, Probe]], None],
               options: Optional[RunOptions] = None) -> Probe:
    """Build a probe chain from "none" | "xgrpo" | "prp" | "sgt" | "xgrpo+sgt" | "sgt:lam=0.3" |
    "pkg.mod:factory:lam=0.2+sgt" (a factory by import path, see ``import_path``) | a list | a Probe;
    "none|xgrpo|prp|sgt" builds a ``switch`` (one compile, chain picked by probe_index).
    options: the run's options, bound into every probe here (``RunOptions.of(grpo_config, tau)``); an explicit
    probe option that contradicts them is a ValueError naming both keys. A ``Probe`` passes through as built."""
    if spec is None:
        return none(options=options)
    if isinstance(spec, Probe):
        return spec
    if isinstance(spec, str) and "|" in spec:
        return switch(*[p for p in spec.split("|") if p.strip()], options=options)
    if isinstance(spec, str):
        parts = [p for p in spec.split("+") if p.strip()]
        if not parts:
            raise ValueError("empty probe spec; use 'none'")
        return chain(*[_parse_one(p, options) for p in parts])
    return chain(*[make_probe(s, options) for s in spec])


def switch(*choices, options: Optional[RunOptions] = None) -> Probe:
    """One compiled update for several probe chains: ``rows.probe_index`` (the update's ``probe_index``
    argument, a traced int) picks the chain that acts; the others run but are masked out. Costs the union
    of the chains' rows (peer slots are always assembled). E.g. ``switch("none", "xgrpo", "prp", "sgt")``.
    For library use (one compile over several chains); a run config names one chain per policy."""
    choices = tuple(make_probe(c, options) for c in choices)
    if not choices:
        raise ValueError("switch needs at least one probe")

    def pick(idx, xs):
        return jnp.stack(xs)[jnp.clip(idx, 0, len(xs) - 1)]

    def masked(idx, ms):
        out = {}
        for i, m in enumerate(ms):
            on = (idx == i).astype(jnp.float32)
            out = grpo.merge_metrics(out, {k: (v[0] * on, v[1] * on) for k, v in m.items()})
        return out

    def extend(rows, see_view, key):
        outs = [c.extend(rows, see_view, key) for c in choices]
        idx = rows.probe_index
        upd = {f: pick(idx, [getattr(o, f) for o, _ in outs]) for f in PER_ROW}
        pooled = [o.pooled_advantages for o, _ in outs]
        if any(x is not None for x in pooled):   # the acting chain's baseline (zeros where a chain does not pool)
            upd["pooled_advantages"] = pick(idx, [jnp.zeros_like(rows.rewards) if x is None else x for x in pooled])
        return rows.replace(**upd), masked(idx, [m for _, m in outs])

    def advantages(rewards, rows, see_view, adv):
        return pick(rows.probe_index, [c.advantages(rewards, rows, see_view, adv) for c in choices])

    def loss_terms(logp, rows):
        ss, ds, ms = [], [], []
        for i, c in enumerate(choices):
            s, d, m = c.loss_terms(logp, rows)
            ss.append(jnp.atleast_1d(s) * (rows.probe_index == i))
            ds.append(jnp.atleast_1d(d))
            ms.append(m)
        return jnp.concatenate(ss), jnp.concatenate(ds), masked(rows.probe_index, ms)

    return Probe("switch(" + ",".join(c.name for c in choices) + ")", extend, advantages, loss_terms,
                 needs_peers=any(c.needs_peers for c in choices),
                 needs_peer_logp=any(c.needs_peer_logp for c in choices), options=choices[0].options)
