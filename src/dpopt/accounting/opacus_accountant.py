"""``PrivacyEngine.accountant``: Opacus's accountant interface, read from the engine's ledger.

Opacus scripts call ``privacy_engine.accountant.get_epsilon(delta=...)``,
``len(accountant)``, ``accountant.history``, ``accountant.mechanism()`` and
``accountant.state_dict()``. :class:`LedgerAccountant` answers each of them
from the engine's :class:`~dpopt.accounting.ledger.PrivacyLedger` — the one
record of every release, written only by the Privatizer — and dpopt's
accountant functions (:func:`dpopt.accounting.accountant.epsilon`). It holds
no record of its own: ``history`` is recomputed from the ledger on every read,
so nothing can make it disagree with what was released.

============================  ====================================================
Opacus                        here
============================  ====================================================
``get_epsilon(delta, ...)``   ε of the whole ledger under this accountant
                              (Opacus's ``alphas=``/``eps_error=`` are accepted;
                              dpopt's accountants choose their own grids)
``get_privacy_spent(delta=)``  ``(ε, best α)`` — RDP only, as in Opacus
``history``                   ``[(noise_multiplier, sample_rate, steps), ...]``,
                              consecutive equal steps merged (as Opacus's ``step``)
``len(accountant)``           ``len(history)`` (Opacus's meaning); ``steps``:
                              the number of releases
``mechanism()``               ``"pld"``, ``"rdp"`` or ``"prv"``
``state_dict()``              ``{"history", "mechanism", "ledger"}``
``load_state_dict(state)``    restores the LEDGER (in place) from ``state["ledger"]``
``step(...)``                 refused: only the Privatizer records releases
============================  ====================================================

Names: Opacus's ``"rdp"`` and ``"prv"`` are dpopt's; dpopt adds ``"pld"`` (its
default). Opacus's ``"gdp"`` (the Gaussian-DP central-limit approximation) is
refused: it is an approximation, not an upper bound on ε, and is loose or
optimistic away from the many-step limit (Dong, Roth, Su 2019, §5).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

from .accountant import epsilon
from .events import flatten_gaussian_terms
from .ledger import PrivacyLedger
from .registry import ACCOUNTANTS, check_accountant

__all__ = ["LedgerAccountant", "resolve_accountant_name"]


def resolve_accountant_name(name: Any) -> str:
    """A dpopt accountant name for a dpopt or Opacus name (case-insensitive).

    Raises:
        ValueError: ``"gdp"`` (with the reason and the names to use instead), or
            an unknown name.
    """
    if str(name).lower() == "gdp":
        raise ValueError(
            "accountant='gdp' (Opacus's Gaussian-DP central-limit approximation) is not supported: "
            "it approximates ε rather than bounding it, and can be optimistic for few steps or "
            f"large sampling rates. Use accountant='pld' (dpopt's default, tight) or 'prv'; "
            f"'rdp' is looser but cheap. Choose one of {', '.join(ACCOUNTANTS)}"
        )
    return check_accountant(name)


class LedgerAccountant:
    """Opacus's ``IAccountant`` interface over a :class:`PrivacyLedger` (module docstring).

    Args:
        ledger: the ledger every release is recorded in, or an object whose
            ``.ledger`` it is (an engine passes itself, so a ledger restored
            from a checkpoint is the one read; copies and pickles stay consistent).
        name: the accountant, ``"pld"``, ``"rdp"`` or ``"prv"`` (Opacus's
            ``"gdp"`` is refused: :func:`resolve_accountant_name`).

    ``str(accountant)`` is the name, and an accountant equals its name
    (``engine.accountant == "rdp"``), so code that treated the attribute as a
    string keeps working.
    """

    def __init__(self, ledger: Any, name: str = "pld"):
        self.name = resolve_accountant_name(name)
        if not isinstance(ledger, PrivacyLedger) and not hasattr(ledger, "ledger"):
            raise TypeError(
                f"LedgerAccountant reads a PrivacyLedger or an object with a .ledger, got {type(ledger).__name__}"
            )
        self._owner = ledger

    @property
    def ledger(self) -> PrivacyLedger:
        """The ledger read (never a copy; for an engine, its current ``engine.ledger``)."""
        owner = self._owner
        return owner if isinstance(owner, PrivacyLedger) else owner.ledger

    # -- Opacus's interface ---------------------------------------------------------
    def mechanism(self) -> str:
        """The accounting mechanism's name (Opacus: ``"rdp"``/``"prv"``; dpopt also ``"pld"``)."""
        return self.name

    def get_epsilon(self, delta: float, *args: Any, **kwargs: Any) -> float:
        """ε(δ) of every release recorded so far (an upper bound; ``math.inf`` after a σ = 0 release).

        Opacus's accountant-specific arguments (RDP's ``alphas``, PRV's
        ``eps_error``/``delta_error``) are accepted and not used: dpopt's
        accountants choose their own grids, documented in
        :mod:`dpopt.accounting.accountant`, so that the result is an upper bound.

        Raises:
            ValueError: δ outside (0, 1).
        """
        if not len(self.ledger):
            return 0.0
        return float(epsilon(self.ledger, delta, self.name))

    def get_privacy_spent(self, *, delta: float, alphas: Optional[list] = None) -> tuple[float, float]:
        """``(ε, best Rényi order α)`` as Opacus's ``RDPAccountant.get_privacy_spent`` (RDP only).

        Args:
            delta: δ in (0, 1).
            alphas: Rényi orders (default dpopt's :data:`~dpopt.accounting.rdp.RDP_ORDERS`).

        Raises:
            AttributeError: for a non-RDP accountant (Opacus has the method on
                its RDP accountant only); use :meth:`get_epsilon`.
            ValueError: a ledger under another neighbouring relation than add/remove-one.
        """
        if self.name != "rdp":
            raise AttributeError(
                f"get_privacy_spent is the RDP accountant's (Opacus); this one is "
                f"{self.name!r}: call get_epsilon(delta)"
            )
        if not len(self.ledger):
            return 0.0, 0.0
        from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

        from .events import ledger_event, ledger_relation
        from .rdp import RDP_ORDERS

        if ledger_relation(self.ledger) != "add_or_remove_one":
            raise ValueError(
                "get_privacy_spent (RDP) supports the add/remove-one relation only; this ledger is "
                f"{ledger_relation(self.ledger)!r}: use a PLD accountant's get_epsilon(delta)"
            )

        orders = list(alphas) if alphas is not None else list(RDP_ORDERS)
        acc = rdp_lib.RdpAccountant(orders)
        acc.compose(ledger_event(self.ledger))
        eps, order = acc.get_epsilon_and_optimal_order(float(delta))
        return float(eps), float(order)

    @property
    def history(self) -> list[tuple[float, float, int]]:
        """``[(noise_multiplier, sample_rate, steps), ...]`` in release order, recomputed from the ledger.

        Consecutive releases with the same (σ, q) are merged, as Opacus's
        ``step`` does. σ is the step's effective multiplier: for adaptive
        clipping (gradient and count Gaussians on one batch) the joint
        (Σ σᵢ⁻²)^(−1/2) (:func:`~dpopt.accounting.events.effective_noise_multiplier`).
        Read-only: a list built anew on every access.
        """
        runs: list[list] = []
        for group in self.ledger.groups:  # run-length groups: O(groups)
            terms = list(flatten_gaussian_terms(group.event).items())
            # one (q, sigma) term per release: the group is one run; several: they alternate, release by release
            for (q, sigma), count in terms if len(terms) == 1 else terms * group.count:
                n = int(count) * (group.count if len(terms) == 1 else 1)
                if runs and runs[-1][0] == sigma and runs[-1][1] == q:
                    runs[-1][2] += n
                else:
                    runs.append([float(sigma), float(q), n])
        return [tuple(r) for r in runs]

    @property
    def steps(self) -> int:
        """The number of releases recorded (the ledger's length)."""
        return len(self.ledger)

    def __len__(self) -> int:
        """``len(history)``, as Opacus (0 before the first step); :attr:`steps` counts releases."""
        return len(self.history)

    def step(self, *, noise_multiplier: Optional[float] = None, sample_rate: Optional[float] = None) -> None:  # noqa: ARG002
        """Refused: the Privatizer records each release itself, with the σ it applied.

        Raises:
            RuntimeError: always (an accountant step without a release would
                charge a release that did not happen, or hide one that did).
        """
        raise RuntimeError(
            "dpopt's accountant reads the ledger, which only the Privatizer writes (one entry per "
            "noisy release, with the sigma it applied): do not call accountant.step(); "
            "optimizer.step() records the step"
        )

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[..., None]:  # noqa: ARG002
        """Refused, as :meth:`step` (Opacus attaches it to its optimizer; dpopt's records by itself)."""
        raise RuntimeError(
            "dpopt's optimizer records every release in the ledger itself; no accountant hook is needed (or allowed)"
        )

    # -- state ---------------------------------------------------------------------
    def state_dict(self, destination: Optional[dict] = None) -> dict:
        """``{"history", "mechanism", "ledger"}`` (Opacus's keys plus the ledger itself, plain data)."""
        out = OrderedDict() if destination is None else destination
        out["history"] = self.history
        out["mechanism"] = self.mechanism()
        out["ledger"] = self.ledger.state_dict()
        return out

    def _adopt(self, saved: dict) -> None:
        """Take a saved ledger without ever forgetting a release.

        An engine's ledger goes through its keeper (the longest record of the run
        among the saved ledger, its journal and the engine's own; other runs or
        branches refused). A bare ledger takes the saved one only if that holds
        every release it already has.
        """
        keeper = getattr(self._owner, "_keeper", None)
        if keeper is not None:
            keeper.adopt(saved, journal=None, where="accountant state", header_fixed=bool(len(self.ledger)))
            keeper.settle(self._owner._privatizers())
            return
        incoming = PrivacyLedger()
        incoming.load_state_dict(saved)
        if not incoming.extends(self.ledger):
            raise ValueError(
                f"refused to load the accountant state: its ledger ({len(incoming)} releases) does "
                f"not hold the {len(self.ledger)} releases this ledger already has (another run, an "
                "older state or another branch); loading it would forget releases"
            )
        self.ledger.load_state_dict(saved)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the ledger (in place) from a :meth:`state_dict`.

        Raises:
            ValueError: an empty state, another mechanism (as Opacus), or a state
                without ``"ledger"`` (an Opacus accountant's ``history`` alone)
                whose history differs from this ledger's: a bare history cannot
                be turned into ledger entries (it lacks the run's header:
                neighbouring relation, sampling, noise mode) — restore with
                ``PrivacyEngine.load_checkpoint`` or a dpopt accountant state.
        """
        if not state_dict:
            raise ValueError("the accountant state is None or empty and cannot be loaded")
        if "mechanism" not in state_dict:
            raise ValueError("the accountant state has no 'mechanism' key")
        if str(state_dict["mechanism"]).lower() != self.name:
            raise ValueError(
                f"an accountant state of {state_dict['mechanism']!r} cannot be loaded into the "
                f"{self.name!r} accountant (create PrivacyEngine(accountant="
                f"{state_dict['mechanism']!r}); the ledger itself is re-scorable by any accountant)"
            )
        if "ledger" in state_dict:
            self._adopt(state_dict["ledger"])
            return
        if [tuple(h) for h in state_dict.get("history", [])] != self.history:
            raise ValueError(
                "this accountant state has a history but no ledger: dpopt cannot rebuild the ledger "
                "(the one record of the releases, with the run's neighbouring relation, sampling and "
                "noise mode) from it. Save and load with dpopt (accountant.state_dict(), "
                "PrivacyEngine.save_checkpoint) so that the ledger travels with the state"
            )

    # -- a name, for code that read the attribute as a string ------------------------
    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return self.name == other.lower()
        if isinstance(other, LedgerAccountant):
            return self.name == other.name and self.ledger is other.ledger
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"LedgerAccountant({self.name!r}, releases={len(self.ledger)})"
