"""The `network:` section: ports and the key of the run's servers."""

from __future__ import annotations

from pydantic import Field, field_validator

from miles_core.config.base import Strict


class NetworkConfig(Strict):
    port_range: str | None = Field(
        None,
        description="keep the ports this run binds inside LOW-HIGH, e.g. '30000-30100': engine "
        "servers, the session server, the trainer's torchrun rendezvous and the weight-group "
        "rendezvous (default: any free port; gloo's peer connections stay ephemeral)",
        examples=["30000-30100"],
    )
    api_key: str | None = Field(
        None,
        pattern=r"^[!-~]+$",  # one HTTP header token: printable ASCII, no spaces
        exclude=True,  # a secret: never in MLflow params, checkpoints or Prefect parameters
        repr=False,
        description="the key the run's servers require ('Authorization: Bearer KEY') and its "
        "clients send (default: MILES_API_KEY from the environment, else a random key per run; "
        "prefer the variable, see docs/security.md)",
    )

    @field_validator("port_range")
    @classmethod
    def _valid_range(cls, v: str | None) -> str | None:
        if v is None:
            return None
        from miles_core.processes.ports import PortRange

        return str(PortRange.parse(v))  # ValueError naming the expected form

    @property
    def ports(self):
        """The range as a `miles_core.processes.ports.PortRange` (None: any port)."""
        from miles_core.processes.ports import PortRange

        return PortRange.parse(self.port_range) if self.port_range else None
