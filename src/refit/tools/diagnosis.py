"""Diagnosis: what `refit doctor` finds, as data: one Check per fact, one Verdict per transport, the Report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"


@dataclass(kw_only=True, slots=True)
class Check:
    """One fact about this machine."""

    name: str
    status: str
    """'ok', 'warn' (works, with a cost or a caveat), 'fail' (rules something out) or 'info'."""
    detail: str
    fix: str = ""
    """What to change, where status is 'warn' or 'fail'."""


@dataclass(kw_only=True, slots=True)
class Verdict:
    """Whether one transport will work here, and if not, why and what to change."""

    transport: str
    status: str
    """'ok', 'warn' (works, degraded or only in some layouts) or 'fail' (cannot work here)."""
    reason: str = ""
    fix: str = ""


@dataclass(kw_only=True, slots=True)
class Report:
    """Every check, and a verdict for each transport asked about."""

    checks: list[Check] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    def by_name(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def failed(self, transports: list[str]) -> list[str]:
        """The transports among `transports` that cannot work here."""
        return [v.transport for v in self.verdicts if v.transport in transports and v.status == FAIL]

    def to_json(self) -> dict:
        return {
            "checks": [asdict(c) for c in self.checks],
            "transports": {v.transport: asdict(v) for v in self.verdicts},
        }
