"""The ledger check: five questions to ask before calling a run DP.

Static check of a run directory (its ledger — the journal ``ledger.jsonl`` when present, else
``ledger.json`` — and ``summary.json``; with both ledger files, a sixth item (f) ``ledger_files``
requires ``ledger.json`` to agree with the journal: :mod:`dpopt.accounting.ledger_files`), after
the four questions of the adaptive-clipping accounting essay (docs/algorithms.md, "The five ledger questions"):

(a) ``releases`` — does every read of the private data have a release in the
    ledger? Per entry the Privatizer's ``reads`` equals its ``releases`` and
    the entry's DpEvent contains exactly ``releases`` Gaussians; the ledger has
    one entry per claimed step; summary-level ``privatizer_reads`` /
    ``privatizer_releases`` agree with each other and with the ledger.
(b) ``noise`` — is every noise std calibrated to the bound actually applied?
    ``noise_std == noise_multiplier × sensitivity``, ``sensitivity ==
    √(Σ_k C_k²)`` of the recorded bounds (never an average or the smallest),
    the event's gradient Gaussian has the recorded multiplier, and the count
    Gaussian's multiplier equals ``count_noise_std / count_sensitivity``
    (with the centred count's sensitivity ½).
(c) ``composition`` — does ε come from one accountant over the whole ledger,
    not a sum? The ledger is re-scored with the run's accountant and δ and
    compared with the summary's ε (relative tolerance ``rtol``, default 1e-6:
    the accountants are deterministic, so an honest run reproduces its ε to
    float rounding). A summary ε below the re-score is under-reported; one
    above means the summary was not computed from this ledger (e.g. releases
    were dropped from it). The ledger's sampling must be Poisson at the
    claimed rate.
(d) ``budget_split`` — does any budget split recompose to the σ claimed?
    From each entry's event: σ_eff = (Σ σᵢ⁻²)^(−1/2) over its Gaussians, which
    must equal the claimed total σ (``noise_multiplier_total`` if present,
    else ``noise_multiplier``; a ``noise_multiplier_schedule`` ``[[first entry,
    σ], ...]`` — a noise scheduler's changes — changes the claim from that entry on).
(e) ``noise_source`` — is the noise secret? The ledger header records how the
    Privatizer's noise and Poisson masks were seeded: ``"secret"`` (OS
    entropy) and ``"secure"`` (CSPRNG) pass; ``"reproducible"`` (seeded from a
    published seed: anyone who knows the seed and the neighbouring dataset can
    replay the run, ε = ∞ against them) fails, and so does ``"unknown"`` (a
    version-1 ledger, written before the noise source was recorded, when
    noise was always seeded from the published seed). A summary ``noise``
    field, if present, must agree with the ledger.

The summary is read only for the keys named below; other keys (present or
absent, e.g. the removed ``nonfinite_steps``) are ignored.

Each item carries human-readable evidence; :func:`check_run` and
:func:`check_ledger` never raise on a failing run — they report it.

This is the command ``dpopt check RUN_DIR``. It is not to be confused with
the argument validators (:mod:`dpopt.accounting.validation`, which raise
``ValueError`` on a bad δ, σ, q, ...) or with ``dpopt.check_model`` (which
refuses model layers that mix examples, e.g. BatchNorm).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, cast

from ..jsonio import loads
from .accountant import epsilon
from .budget import COUNT_SENSITIVITY
from .events import EventSummary, effective_noise_multiplier, summarize_event
from .ledger import PrivacyLedger
from .ledger_files import compare_ledger_files
from .registry import ACCOUNTANTS
from .validation import check_delta, check_rtol

__all__ = ["CheckItem", "CheckResult", "check_ledger", "check_run", "DEFAULT_RTOL", "RunIdGroup", "repeated_run_ids"]

#: Relative tolerance for comparing recomputed numbers with recorded ones.
DEFAULT_RTOL = 1e-6
_MAX_LISTED = 3  # offending entries quoted per problem

QUESTIONS = {
    "releases": "Does every read of the private data have a release in the ledger?",
    "noise": "Is every noise std calibrated to the bound actually applied?",
    "composition": "Does the epsilon come from one accountant over the whole ledger (not a sum)?",
    "budget_split": "Does the budget split recompose to the sigma claimed?",
    "noise_source": "Is the noise secret (not reproducible from a published seed)?",
    "ledger_files": "Does ledger.json say what the journal ledger.jsonl says?",
}


@dataclass(frozen=True)
class CheckItem:
    """One of the check questions, answered.

    Attributes:
        key: ``"releases"``, ``"noise"``, ``"composition"``, ``"budget_split"``
            or ``"noise_source"``.
        question: the question in words.
        passed: True if no problem was found.
        evidence: what was compared (numbers), problems first.
    """

    key: str
    question: str
    passed: bool
    evidence: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"key": self.key, "question": self.question, "passed": self.passed, "evidence": list(self.evidence)}


@dataclass(frozen=True)
class CheckResult:
    """The :class:`CheckItem` results (a–e); ``passed`` only if all passed."""

    items: tuple[CheckItem, ...]
    facts: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(item.passed for item in self.items)

    def __getitem__(self, key: str) -> CheckItem:
        for item in self.items:
            if item.key == key:
                return item
        raise KeyError(key)

    @property
    def failures(self) -> list[str]:
        """Keys of the failed items."""
        return [item.key for item in self.items if not item.passed]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "items": [i.to_dict() for i in self.items], "facts": self.facts}

    def format(self) -> str:
        """Plain-text report (one block per question)."""
        files = self.facts.get("ledger_files")
        lines = [f"checked: {', '.join(files)}"] if files else []
        for tag, item in zip("abcdefgh", self.items):
            lines.append(f"({tag}) [{'PASS' if item.passed else 'FAIL'}] {item.question}")
            lines.extend(f"      - {e}" for e in item.evidence)
        lines.append("RESULT: " + ("PASS" if self.passed else "FAIL (" + ", ".join(self.failures) + ")"))
        return "\n".join(lines)


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=1e-12)


def _num(x: Any) -> Optional[float]:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if not math.isnan(v) else None


def _valid_delta(delta: Optional[float]) -> bool:
    """δ as the accountants accept it (:func:`~dpopt.accounting.validation.check_delta`), as a yes/no."""
    try:
        check_delta(delta)
    except ValueError:
        return False
    return True


def _summarise(problems: list[str], label: str) -> list[str]:
    if not problems:
        return []
    shown = problems[:_MAX_LISTED]
    more = f" (and {len(problems) - len(shown)} more)" if len(problems) > len(shown) else ""
    return [f"{len(problems)} {label}{more}: " + "; ".join(shown)]


# ---------------------------------------------------------------------------
# the items
# ---------------------------------------------------------------------------
def _check_releases(ledger: PrivacyLedger, parsed: list[EventSummary], claimed: Mapping) -> CheckItem:
    problems: list[str] = []
    evidence: list[str] = []
    mismatch, no_meta, nonpriv = [], [], []
    total_reads = total_releases = 0
    for entry, p in zip(ledger.entries, parsed):
        reads, rel = entry.meta.get("reads"), entry.meta.get("releases")
        if reads is None or rel is None:
            no_meta.append(f"step {entry.step}")
            continue
        total_reads += int(reads)
        total_releases += int(rel)
        if int(reads) != int(rel) or len(p.gaussians) != int(rel):
            mismatch.append(f"step {entry.step}: reads {reads}, releases {rel}, Gaussians in event {len(p.gaussians)}")
        if p.nonprivate:
            nonpriv.append(f"step {entry.step}")
    problems += _summarise(
        mismatch,
        "entries where reads, recorded releases and the event's Gaussians disagree (a read without its release)",
    )
    problems += _summarise(no_meta, "entries without reads/releases metadata (cannot show every read is released)")
    problems += _summarise(nonpriv, "entries with a NonPrivateDpEvent (a release without noise)")
    evidence.append(
        f"{len(ledger)} ledger entries; per-entry reads total {total_reads}, releases total {total_releases}"
    )
    steps = claimed.get("steps")
    if steps is not None:
        if int(steps) != len(ledger):
            problems.append(
                f"summary claims {steps} steps but the ledger has {len(ledger)} entries "
                "(every step must be one ledger entry)"
            )
        else:
            evidence.append(f"summary steps = {steps} = ledger entries")
    s_reads, s_rel = claimed.get("privatizer_reads"), claimed.get("privatizer_releases")
    if s_reads is not None or s_rel is not None:
        if s_reads is None or s_rel is None:
            problems.append("summary has only one of privatizer_reads / privatizer_releases")
        else:
            if int(s_reads) != int(s_rel):
                problems.append(
                    f"summary: privatizer_reads {s_reads} != privatizer_releases {s_rel} "
                    f"({int(s_reads) - int(s_rel)} reads of private data were never released/charged)"
                )
            if int(s_rel) != total_releases:
                problems.append(
                    f"summary: privatizer_releases {s_rel} != releases recorded in the ledger {total_releases}"
                )
            if not problems:
                evidence.append(f"summary privatizer_reads = privatizer_releases = {s_rel} = ledger releases")
    if len(ledger) == 0:
        problems.append("the ledger is empty")
    if not problems:
        evidence.insert(0, "every entry: reads = releases = number of Gaussians in its event")
    return CheckItem("releases", QUESTIONS["releases"], not problems, tuple(problems + evidence))


def _bounds(meta: Mapping) -> Optional[list[float]]:
    c = meta.get("max_grad_norm")
    if c is None:
        return None
    values = c if isinstance(c, (list, tuple)) else [c]
    out = [_num(v) for v in values]
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


def _check_noise(ledger: PrivacyLedger, parsed: list[EventSummary], rtol: float) -> CheckItem:
    std_bad, sens_bad, grad_bad, count_bad, missing, zero = [], [], [], [], [], []
    sens_seen, count_seen = set(), 0
    for entry, p in zip(ledger.entries, parsed):
        m = entry.meta
        sigma, sens, std = _num(m.get("noise_multiplier")), _num(m.get("sensitivity")), _num(m.get("noise_std"))
        bounds = _bounds(m)
        if None in (sigma, sens, std) or bounds is None:
            missing.append(f"step {entry.step}")
            continue
        sigma, sens, std = cast(float, sigma), cast(float, sens), cast(float, std)  # not None: checked above
        total = math.sqrt(sum(c * c for c in bounds))
        if sigma == 0.0:
            zero.append(f"step {entry.step}")
        sens_seen.add(round(sens, 12))
        if not _close(sens, total, rtol):
            sens_bad.append(
                f"step {entry.step}: sensitivity {sens:.6g} but √(Σ C_k²) of bounds "
                f"{[round(c, 6) for c in bounds]} is {total:.6g}"
            )
        if not _close(std, sigma * sens, rtol):
            std_bad.append(
                f"step {entry.step}: noise_std {std:.6g} != noise_multiplier {sigma:.6g} × "
                f"sensitivity {sens:.6g} = {sigma * sens:.6g}"
            )
        if not p.gaussians or not _close(p.gaussians[0], sigma, rtol):
            got = p.gaussians[0] if p.gaussians else "none"
            grad_bad.append(f"step {entry.step}: event gradient multiplier {got} != recorded {sigma:.6g}")
        has_count_meta = "count_noise_std" in m or "count_sensitivity" in m
        if has_count_meta:
            count_seen += 1
            cstd, csens = _num(m.get("count_noise_std")), _num(m.get("count_sensitivity"))
            if cstd is None or csens is None or csens <= 0:
                count_bad.append(f"step {entry.step}: count noise std/sensitivity missing or invalid")
            elif len(p.gaussians) < 2:
                count_bad.append(
                    f"step {entry.step}: count noise std {cstd:.6g} recorded but the event has no count Gaussian"
                )
            else:
                if not _close(p.gaussians[1], cstd / csens, rtol):
                    count_bad.append(
                        f"step {entry.step}: event count multiplier {p.gaussians[1]:.6g} != "
                        f"count_noise_std/count_sensitivity = {cstd / csens:.6g}"
                    )
                if csens < COUNT_SENSITIVITY * (1 - rtol):
                    count_bad.append(
                        f"step {entry.step}: count_sensitivity {csens} understates the centred "
                        f"count's sensitivity {COUNT_SENSITIVITY}"
                    )
                cm = _num(m.get("count_noise_multiplier"))
                if cm is not None and not _close(cm, p.gaussians[1], rtol):
                    count_bad.append(
                        f"step {entry.step}: recorded count_noise_multiplier {cm:.6g} != event's {p.gaussians[1]:.6g}"
                    )
        elif len(p.gaussians) >= 2:
            count_bad.append(
                f"step {entry.step}: the event has {len(p.gaussians)} Gaussians but only the "
                "gradient's noise is recorded (no count_noise_std / count_sensitivity)"
            )
    problems = (
        _summarise(zero, "entries released WITHOUT noise (noise_multiplier 0: not private, epsilon = inf)")
        + _summarise(missing, "entries without noise_multiplier/sensitivity/noise_std/max_grad_norm")
        + _summarise(sens_bad, "entries whose sensitivity is not the total bound √(Σ C_k²)")
        + _summarise(std_bad, "entries whose noise std is not σ × sensitivity")
        + _summarise(grad_bad, "entries whose event does not carry the recorded gradient σ")
        + _summarise(count_bad, "entries with count-release problems")
    )
    evidence = []
    if not problems:
        evidence.append(
            f"all {len(ledger)} entries: noise_std = noise_multiplier × sensitivity, "
            "sensitivity = √(Σ C_k²), event multiplier = recorded σ"
        )
        if sens_seen:
            seen = sorted(sens_seen)
            evidence.append(f"sensitivities seen: {len(seen)} distinct value(s), from {seen[0]:.6g} to {seen[-1]:.6g}")
        if count_seen:
            evidence.append(
                f"{count_seen} count releases: event multiplier = count_noise_std / "
                f"count_sensitivity (sensitivity {COUNT_SENSITIVITY})"
            )
    return CheckItem("noise", QUESTIONS["noise"], not problems, tuple(problems + evidence))


def _check_composition(
    ledger: PrivacyLedger, parsed: list[EventSummary], claimed: Mapping, rtol: float
) -> tuple[CheckItem, dict]:
    problems, evidence, facts = [], [], {}
    run_id, claimed_id = getattr(ledger, "run_id", None), claimed.get("ledger_run_id")
    if run_id is not None and claimed_id is not None and claimed_id != run_id:
        problems.append(
            f"summary ledger_run_id {claimed_id} is not the ledger's run_id {run_id}: the summary and the "
            "ledger are files of different runs"
        )
    accountant = str(claimed.get("accountant", "")).lower()
    delta, eps_claim = _num(claimed.get("delta")), claimed.get("epsilon")
    eps_claim = math.inf if eps_claim in ("inf", "Infinity") else _num(eps_claim)
    if accountant not in ACCOUNTANTS:
        problems.append(f"summary accountant {claimed.get('accountant')!r} is not one of {ACCOUNTANTS}")
    if not _valid_delta(delta):
        problems.append(f"summary delta {claimed.get('delta')!r} is missing or not in (0, 1)")
    if eps_claim is None:
        problems.append("summary has no numeric epsilon")
    if ledger.sampling != "poisson" and not _mechanism_sampled(ledger):
        problems.append(
            f"ledger sampling is {ledger.sampling!r}; the accountants assume Poisson sampling, "
            "so the epsilon does not hold for this run"
        )
    others = sorted({o for p in parsed for o in p.unsupported})
    if others:
        problems.append(f"ledger has events the check does not understand: {others}")
    rates = sorted({r for p in parsed for r in p.rates})
    q_claim = _num(claimed.get("sample_rate"))
    if q_claim is not None and rates and any(not _close(r, q_claim, rtol) for r in rates):
        problems.append(f"ledger sampling rates {rates[:3]} differ from the claimed sample_rate {q_claim:g}")
    elif rates:
        evidence.append(
            f"ledger sampling rate(s) {', '.join(f'{r:g}' for r in rates[:3])}"
            + (" = claimed sample_rate" if q_claim is not None else "")
        )
    if not problems:
        try:
            eps_ledger = epsilon(ledger, delta, accountant)  # type: ignore[arg-type]
        except (ValueError, ImportError) as exc:
            problems.append(f"could not re-score the ledger with {accountant!r}: {exc}")
        else:
            facts["epsilon_ledger"] = eps_ledger
            # one-sided: a claim below the re-scored ε is an under-report however small (1e-9: float noise)
            under = eps_claim < eps_ledger * (1.0 - 1e-9)  # type: ignore[operator]
            same = not under and ((eps_ledger == eps_claim) or _close(eps_ledger, eps_claim, rtol))  # type: ignore[arg-type]
            where = f"re-scored whole ledger ({len(ledger)} releases, {accountant}, δ={delta:g}): ε = {eps_ledger:.6g}"
            if same:
                evidence.append(f"{where} = summary ε {eps_claim:.6g} (rtol {rtol:g})")
            elif eps_claim < eps_ledger:  # type: ignore[operator]
                problems.append(f"summary ε {eps_claim:.6g} is BELOW the {where}: under-reported")
            else:
                problems.append(
                    f"summary ε {eps_claim:.6g} is above the {where}: the summary was not "
                    "computed from this ledger (releases missing from the ledger, or a "
                    "different composition)"
                )
    return CheckItem("composition", QUESTIONS["composition"], not problems, tuple(problems + evidence)), facts


def _scheduled_sigmas(schedule, sigma_claim: Optional[float], n: int) -> list[Optional[float]]:
    """The σ claimed for each of ``n`` entries: ``sigma_claim``, changed at the entry indices of a
    ``noise_multiplier_schedule`` (``[[first entry, σ], ...]``, e.g. Opacus's noise schedulers)."""
    claimed = [sigma_claim] * n
    for start, sigma in sorted((int(a), _num(b)) for a, b in (schedule or [])):
        claimed[max(0, start) :] = [sigma] * max(0, n - max(0, start))
    return claimed


def _check_split(
    ledger: PrivacyLedger, parsed: list[EventSummary], claimed: Mapping, rtol: float
) -> tuple[CheckItem, dict]:
    problems, evidence, facts = [], [], {}
    key = "noise_multiplier_total" if claimed.get("noise_multiplier_total") is not None else "noise_multiplier"
    sigma_claim = _num(claimed.get(key))
    if sigma_claim is None:
        problems.append("summary has no noise_multiplier (or noise_multiplier_total) to compare with")
    claimed_at = _scheduled_sigmas(claimed.get("noise_multiplier_schedule"), sigma_claim, len(parsed))
    pieces: dict[tuple, int] = {}
    for i, p in enumerate(parsed):
        if p.gaussians:
            tup = (tuple(p.gaussians), claimed_at[i])
            pieces[tup] = pieces.get(tup, 0) + 1
    bad = []
    for (tup, sigma_claim), n in pieces.items():
        sigma_eff = effective_noise_multiplier(tup)
        desc = " ⊕ ".join(f"{s:.6g}" for s in tup)
        line = f"{n} entries release Gaussians σ = {desc} → σ_eff = {sigma_eff:.6g}"
        if len(tup) == 2 and tup[1] > 0:
            r = (sigma_eff / tup[1]) ** 2
            line += f" (count share r = {r:.4g}, gradient noise ×{tup[0] / sigma_eff:.4f})"
            share = _num(claimed.get("count_share"))
            if share is not None and not _close(share, r, max(rtol, 1e-9)):
                bad.append(f"{n} entries imply count share {r:.6g} but the summary claims {share:.6g}")
        if sigma_claim is not None and not _close(sigma_eff, sigma_claim, rtol):
            bad.append(
                f"{line}, but the run claims σ = {sigma_claim:.6g} ({key}): the pieces do not add "
                "up — a release is missing from the ledger or the split is wrong"
            )
        else:
            evidence.append(line + (f" = claimed {key} {sigma_claim:.6g}" if sigma_claim is not None else ""))
    if not pieces:
        problems.append("no Gaussian releases in the ledger to recompose")
    facts["sigma_eff"] = sorted({effective_noise_multiplier(t) for t, _ in pieces})
    problems += bad
    return CheckItem("budget_split", QUESTIONS["budget_split"], not problems, tuple(problems + evidence)), facts


def _mechanism_sampled(ledger: PrivacyLedger) -> bool:
    """Whether the ledger's sampling is the one its correlated-noise record requires (its events are exact
    for that cyclic participation; False without a record)."""
    from .matrix_factorization import record_sampling, same_sampling

    return same_sampling(getattr(ledger, "sampling", None), record_sampling(getattr(ledger, "mechanism", None)))


def _check_mechanism(
    ledger: PrivacyLedger, parsed: list[EventSummary], claimed: Mapping, rtol: float
) -> tuple[CheckItem, CheckItem, CheckItem, dict]:
    """Questions (a), (b) and (d) for a correlated-noise ledger (:mod:`dpopt.correlated_noise`).

    (a) every entry reads once and releases once, its event holding at most that one Gaussian (a no-op
    when the release adds no sensitivity); (b) noise_std = σ × sensitivity per entry, σ = the record's,
    and every event and ``mechanism_sensitivity`` re-derived from the record alone
    (:func:`~dpopt.correlated_noise.check_record`); (d) the entries' Gaussians compose (μ² adds) to
    Gaussian(σ/Δ_t) of the last release t, and σ is the claimed noise_multiplier.
    """
    from .matrix_factorization import check_record

    rec = cast(dict, ledger.mechanism)
    rel_bad, noise_bad = [], []
    for entry, p in zip(ledger.entries, parsed):
        m = entry.meta
        if m.get("reads") != 1 or m.get("releases") != 1 or len(p.gaussians) > 1 or p.unsupported:
            rel_bad.append(f"step {entry.step}: reads {m.get('reads')}, releases {m.get('releases')}")
        sigma, sens, std = _num(m.get("noise_multiplier")), _num(m.get("sensitivity")), _num(m.get("noise_std"))
        if sigma is None or sens is None or std is None or not _close(std, sigma * sens, rtol):
            noise_bad.append(f"step {entry.step}: noise_std {std} != noise_multiplier {sigma} × sensitivity {sens}")
        elif not _close(sigma, float(rec.get("noise_multiplier", math.nan)), rtol):
            noise_bad.append(
                f"step {entry.step}: noise_multiplier {sigma} != the mechanism's {rec.get('noise_multiplier')}"
            )
    problems_a = _summarise(rel_bad, "entries that are not one read and one release") + (
        ["the ledger is empty"] if len(ledger) == 0 else []
    )
    steps = claimed.get("steps")
    if steps is not None and int(steps) != len(ledger):
        problems_a.append(f"summary claims {steps} steps but the ledger has {len(ledger)} entries")
    derived = check_record(rec, ledger.entries, rtol)
    problems_b = _summarise(noise_bad, "entries whose noise is not σ × sensitivity") + derived
    evidence_b = (
        [] if problems_b else [f"{rec.get('kind')} mechanism re-derived from the ledger header: every event matches"]
    )
    a = CheckItem(
        "releases", QUESTIONS["releases"], not problems_a, tuple(problems_a) or ("one read, one release per entry",)
    )
    b = CheckItem("noise", QUESTIONS["noise"], not problems_b, tuple(problems_b + evidence_b))
    inv = sum(g**-2 for p in parsed for g in p.gaussians if g > 0)
    last = ledger.entries[-1].meta.get("mechanism_sensitivity") if len(ledger) else None
    sigma_claim = _num(claimed.get("noise_multiplier"))
    problems_d, evidence_d = [], []
    if rec.get("sample_rate") is not None:  # amplified (cyclic Poisson): rounds of sampled Gaussians, not μ² adding
        if sigma_claim is None or not _close(sigma_claim, float(rec.get("noise_multiplier", math.nan)), rtol):
            problems_d.append(
                f"claimed noise_multiplier {sigma_claim} != the mechanism's {rec.get('noise_multiplier')}"
            )
        else:
            evidence_d.append("amplified rounds (Poisson-sampled Gaussians) re-derived from the record: see (b)")
    elif sigma_claim is None or last is None or inv <= 0:
        problems_d.append("no claimed noise_multiplier, or no Gaussian release to recompose")
    else:
        composed = inv**-0.5
        if not _close(composed, sigma_claim / float(last), rtol):
            problems_d.append(
                f"the entries compose to Gaussian σ_eff = {composed:.6g}, not σ/Δ = {sigma_claim:.6g}/{float(last):.6g}"
            )
        else:
            evidence_d.append(f"entries compose to one Gaussian σ/Δ_t = {composed:.6g} (σ = {sigma_claim:.6g})")
    d = CheckItem("budget_split", QUESTIONS["budget_split"], not problems_d, tuple(problems_d + evidence_d))
    return a, b, d, {"sigma_eff": [inv**-0.5] if inv > 0 else []}


def _check_noise_source(ledger: PrivacyLedger, claimed: Mapping) -> CheckItem:
    problems, evidence = [], []
    mode = getattr(ledger, "noise", "unknown")
    if mode == "reproducible":
        problems.append(
            "noise reproducible from a published seed: the ledger records noise = 'reproducible' "
            "(a research mode); anyone who knows the seed and the neighbouring dataset can replay "
            "the run and tell the datasets apart, so the epsilon does not hold"
        )
    elif mode == "unknown":
        problems.append(
            "the ledger predates the record of its noise source (format version 1, noise = "
            "'unknown'; such runs seeded the noise from the published seed) and must be treated as "
            "reproducible: noise reproducible from a published seed"
        )
    elif mode in ("secret", "secure"):
        evidence.append(
            f"ledger noise = {mode!r}: "
            + (
                "seeded from OS entropy and never written anywhere"
                if mode == "secret"
                else "drawn from a cryptographically secure generator"
            )
        )
    else:
        problems.append(f"ledger noise {mode!r} is not a known noise source")
    claim = claimed.get("noise")
    if claim is not None and claim != mode:
        problems.append(f"summary noise {claim!r} differs from the ledger's {mode!r}")
    size = getattr(ledger, "dataset_size", None)
    if size is not None:
        meaning = {
            "public": "N is treated as public",
            "unused": "the sample rate was given explicitly; nothing recorded is derived from N",
        }.get(size, "statement about N")
        evidence.append(f"dataset_size = {size!r} ({meaning})")
    return CheckItem("noise_source", QUESTIONS["noise_source"], not problems, tuple(problems + evidence))


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------
def check_ledger(ledger: PrivacyLedger, claimed: Mapping[str, Any], rtol: float = DEFAULT_RTOL) -> CheckResult:
    """Run the ledger checks (a–e) on a ledger against a run's claims.

    Args:
        ledger: the run's :class:`~dpopt.accounting.ledger.PrivacyLedger`.
        claimed: the run's summary (``summary.json``): keys ``epsilon``,
            ``delta``, ``accountant``, ``noise_multiplier`` (total σ claimed),
            optionally ``noise_multiplier_total``, ``sample_rate``, ``steps``,
            ``privatizer_reads``, ``privatizer_releases``, ``count_share``,
            ``noise``. Other keys are ignored (e.g. ``nonfinite_steps``,
            which runs no longer write).
        rtol: relative tolerance of every numeric comparison (default 1e-6;
            recorded numbers are JSON floats, recomputations are deterministic).

    Returns:
        :class:`CheckResult` with items releases, noise, composition,
        budget_split, noise_source (in that order), each with evidence; never
        raises for a failing run.

    Raises:
        TypeError: if ``ledger`` is not a PrivacyLedger or ``claimed`` not a mapping.
        ValueError: if ``rtol`` is not in (0, 0.1].

    Source: the four questions of the adaptive-clipping accounting essay (docs/algorithms.md, "The five ledger questions");
    DESIGN.md "Accounting rules".
    """
    if not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}")
    if not isinstance(claimed, Mapping):
        raise TypeError(f"claimed must be a mapping (the run's summary), got {type(claimed).__name__}")
    rtol = check_rtol(rtol)
    # per entry, from the shared DpEvent walker: gaussians (recorded order), rates, nonprivate, unsupported
    parsed = [summarize_event(e.event) for e in ledger.entries]
    if getattr(ledger, "mechanism", None) is not None:  # correlated noise: (a), (b), (d) from the mechanism record
        a, b, d, facts_d = _check_mechanism(ledger, parsed, claimed, rtol)
        c, facts_c = _check_composition(ledger, parsed, claimed, rtol)
    else:
        a = _check_releases(ledger, parsed, claimed)
        b = _check_noise(ledger, parsed, rtol)
        c, facts_c = _check_composition(ledger, parsed, claimed, rtol)
        d, facts_d = _check_split(ledger, parsed, claimed, rtol)
    e = _check_noise_source(ledger, claimed)
    facts = {**facts_c, **facts_d, "entries": len(ledger), "noise": getattr(ledger, "noise", "unknown")}
    return CheckResult((a, b, c, d, e), facts)


@dataclass(frozen=True)
class RunIdGroup:
    """Ledgers that carry one run id (see :func:`repeated_run_ids`).

    Attributes:
        run_id: the shared id.
        names: the ledgers' names (run directories), in the order given.
        diverged: True when no one of them holds all the others' releases: a copied run
            directory resumed in both places (two branches of one run, both trained on the data).
        shared_releases: releases every one of them holds (the common prefix).
        combined_releases: the shared releases once plus every branch's own releases.
        combined_epsilon: ε of those combined releases (None when not diverged or not scored).
    """

    run_id: str
    names: tuple
    diverged: bool
    shared_releases: int
    combined_releases: int
    combined_epsilon: Optional[float] = None

    def message(self) -> str:
        """One line for the user."""
        names = ", ".join(str(n) for n in self.names)
        if not self.diverged:
            return (
                f"{names} share run id {self.run_id}: copies of one run; one of them holds every release "
                "of the others, so its ε covers them all"
            )
        eps = "" if self.combined_epsilon is None else f" = ε {self.combined_epsilon:.6g}"
        return (
            f"{names} share run id {self.run_id} and DIVERGE after {self.shared_releases} shared releases: "
            "copies of one run directory trained further in each place. Each ledger alone shows only its "
            f"own branch; together they released {self.combined_releases} times from the same data{eps} "
            "(the shared releases counted once, every branch's own added)"
        )

    def to_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "names": [str(n) for n in self.names],
            "diverged": self.diverged,
            "shared_releases": self.shared_releases,
            "combined_releases": self.combined_releases,
            "combined_epsilon": self.combined_epsilon,
        }


def _shared_prefix(ledgers: list[PrivacyLedger]) -> int:
    first, n = ledgers[0].entries, min(len(b) for b in ledgers)
    for i in range(n):
        if any(b.entries[i] != first[i] for b in ledgers[1:]):
            return i
    return n


def _split_step(lists: list[list]) -> Optional[int]:
    """The step where segment lists first differ (the earliest ``from_step`` there); None if none differs."""
    for i in range(max(len(s) for s in lists)):
        here = [s[i] for s in lists if i < len(s)]
        if len(here) < len(lists) or any(seg.get("id") != here[0].get("id") for seg in here):
            return min(int(seg.get("from_step", 0)) for seg in here)
    return None


def repeated_run_ids(
    named: Mapping[str, PrivacyLedger],
    delta: Optional[float] = None,
    accountant: str = "pld",
    segments: Optional[Mapping[str, list]] = None,
) -> list[RunIdGroup]:
    """Groups of ledgers that share a run id (ledgers without one are skipped).

    A run id is made once per run (:func:`~dpopt.accounting.ledger.new_run_id`), so two ledgers with
    one id are copies of one run. When one holds the others' releases (a backup) that is all; when
    they diverge (the copied directory was resumed in both places), every ledger passes its own check
    while the data was used by every branch: the group's ``combined_epsilon`` scores the shared
    releases once plus every branch's own (with ``delta`` and ``accountant``; not scored if ``delta``
    is None).

    Ledger entries of two branches with the same schedule are equal (same events), so a ledger alone
    cannot show a branch: ``segments`` (``summary.json``'s ``"segments"`` per name, see
    :func:`dpopt.training.results.new_segment`) does — one ledger holds another only if that one's
    segments are a prefix of its own.
    """
    segments = segments or {}

    def holds(big: str, small: str) -> bool:
        if not named[big].extends(named[small]):
            return False
        a, b = segments.get(big), segments.get(small)
        return a is None or b is None or [s.get("id") for s in b] == [s.get("id") for s in a[: len(b)]]

    by_id: dict[str, list[str]] = {}
    for name, book in named.items():
        if getattr(book, "run_id", None) is not None:
            by_id.setdefault(book.run_id, []).append(name)  # type: ignore[arg-type]
    groups = []
    for run_id, names in by_id.items():
        if len(names) < 2:
            continue
        tips: list[str] = []  # the branches: ledgers no other one of the group holds
        for name in sorted(names, key=lambda n: (-len(named[n]), -len(segments.get(n) or []))):
            if not any(holds(t, name) for t in tips):
                tips.append(name)
        maximal = [named[t] for t in tips]
        diverged = len(maximal) > 1
        shared = _shared_prefix(maximal)
        split = _split_step([segments[t] for t in tips]) if diverged and all(segments.get(t) for t in tips) else None
        if split is not None:
            shared = min(shared, split)
        combined, eps = len(maximal[0]), None
        if diverged:
            first = maximal[0]
            union = PrivacyLedger(first.neighbouring, first.sampling, first.noise, first.dataset_size, run_id=run_id)
            kept = list(first.entries[:shared]) + [e for b in maximal for e in b.entries[shared:]]
            for entry in kept:
                union.record(entry.step, entry.event, **entry.meta)
            combined = len(union)
            if delta is not None:
                eps = epsilon(union, delta, accountant)
        groups.append(RunIdGroup(run_id, tuple(names), diverged, shared, combined, eps))
    return groups


ENGINE_RUN_FILES = ("privacy_ledger.json", "privacy_summary.json")
"""The ledger and summary a Hugging Face ``DPTrainer`` checkpoint (``checkpoint-N/``) holds, in place of a
``dpopt train`` run directory's ``ledger.json`` and ``summary.json``."""


def run_paths(run: Path) -> tuple[Path, Path]:
    """(ledger, summary) of a run directory: ``ledger.json``/``summary.json``, or a DPTrainer checkpoint's
    :data:`ENGINE_RUN_FILES` when the directory has no ``summary.json`` but those."""
    ledger, summary = (run / name for name in ENGINE_RUN_FILES)
    if not (run / "summary.json").exists() and ledger.exists() and summary.exists():
        return ledger, summary
    return run / "ledger.json", run / "summary.json"


def load_run(run_dir: str | Path) -> tuple[PrivacyLedger, dict]:
    """Read ``ledger.json`` and ``summary.json`` from a run directory (or a DPTrainer checkpoint's
    ``privacy_ledger.json`` and ``privacy_summary.json``: :func:`run_paths`).

    Raises:
        FileNotFoundError: if the directory or either file is missing.
        ValueError: if a file is not valid JSON or not a dpopt ledger.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(
            f"{run} is not a run directory (expected ledger.json and summary.json inside, "
            "or a DPTrainer checkpoint's privacy_ledger.json and privacy_summary.json)"
        )
    ledger_path, summary_path = run_paths(run)
    if not summary_path.exists() and not (run / "config.json").exists():  # not a `dpopt train` run at all
        saved = next((p for p in (run / "ledger.json", run / "ledger.jsonl", ledger_path) if p.exists()), None)
        raise FileNotFoundError(
            f"no summary.json or config.json in {run}: `dpopt check` checks `dpopt train` run directories (or "
            "a directory holding a ledger.json and the summary.json of engine.summary(delta))"
            + (f"; `dpopt ledger {saved}` scores a saved ledger" if saved is not None else "")
        )
    if not summary_path.exists():
        from .run_continuation import continuation

        raise FileNotFoundError(
            f"no summary.json in {run}: the run stopped before its end (killed, a failed write) or is still "
            f"running. {continuation(run).advice()} (`dpopt ledger {run}` scores the releases journaled so far)"
        )
    # a dpopt train run: the journal when there is one (the releases `dpopt ledger` scores)
    ledger = PrivacyLedger.load(run if ledger_path.name == "ledger.json" else ledger_path)
    try:
        summary = loads(summary_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{summary_path} is not valid JSON: {exc}") from exc
    if not isinstance(summary, dict):
        raise ValueError(f"{summary_path} must hold a JSON object")
    return ledger, summary


def check_run(run_dir: str | Path, rtol: float = DEFAULT_RTOL) -> CheckResult:
    """Run :func:`check_ledger` on a run directory (``ledger.json`` + ``summary.json``).

    The checks (a)-(e) read the journal ``ledger.jsonl`` when the run has one (every release, fsync-ed as
    the run went), else ``ledger.json``. When both exist a sixth item, ``ledger_files``, compares them
    (:func:`~dpopt.accounting.ledger_files.compare_ledger_files`): it fails with ``"ledger.json disagrees
    with ledger.jsonl: …"`` naming the first difference (header, mechanism record, sampling or an entry),
    and passes with a note when ``ledger.json`` is the prefix an earlier stop of a resumed run left.
    ``facts["ledger_files"]`` names the files read (the report's first line).

    Raises:
        FileNotFoundError, ValueError: unreadable run directory (see :func:`load_run`).
    """
    run = Path(run_dir)
    ledger, summary = load_run(run)
    result = check_ledger(ledger, summary, rtol)
    ledger_path, _ = run_paths(run)
    if ledger_path.name != "ledger.json":  # a DPTrainer checkpoint: one ledger file
        return CheckResult(result.items, {**result.facts, "ledger_files": [ledger_path.name]})
    steps = _num(summary.get("steps"))
    # load_run read the journal when there is one: compared as read (parsed once)
    files = compare_ledger_files(run, None if steps is None else int(steps), journal=ledger)
    facts = {**result.facts, "ledger_files": list(files.files)}
    if len(files.files) < 2:
        return CheckResult(result.items, facts)
    evidence = [files.disagreement] if files.disagreement else ["ledger.json and ledger.jsonl hold the same ledger"]
    if files.note:
        evidence = [f"note: {files.note}"]
    item = CheckItem("ledger_files", QUESTIONS["ledger_files"], files.disagreement is None, tuple(evidence))
    return CheckResult(result.items + (item,), facts)
