"""Site-wide defaults for the worker pods, set by whoever installs the operator.

The helm chart turns its `workers.*` values into these environment variables of the operator's
container; `dtjob operator` reads them once at start (`from_env(os.environ)`) into its settings
(`ReconcilerSettings.workers`), and `manifests.worker_pod` applies the defaults it is given. A job's own
spec.template always wins: each default fills a field the template leaves unset (key by key inside
the security contexts), and the operator's built-in defaults (no token, non-root, no privilege
escalation, no capabilities) fill what is still unset.

  DTJOB_WORKER_SERVICE_ACCOUNT                  ServiceAccount name ("" = the namespace's default)
  DTJOB_WORKER_AUTOMOUNT_SERVICE_ACCOUNT_TOKEN  "true" or "false"
  DTJOB_WORKER_POD_SECURITY_CONTEXT             JSON object, a PodSecurityContext
  DTJOB_WORKER_SECURITY_CONTEXT                 JSON object, a SecurityContext for each container
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_SERVICE_ACCOUNT = "DTJOB_WORKER_SERVICE_ACCOUNT"
ENV_AUTOMOUNT = "DTJOB_WORKER_AUTOMOUNT_SERVICE_ACCOUNT_TOKEN"
ENV_POD_SECURITY_CONTEXT = "DTJOB_WORKER_POD_SECURITY_CONTEXT"
ENV_SECURITY_CONTEXT = "DTJOB_WORKER_SECURITY_CONTEXT"


class WorkerDefaultsError(ValueError):
    """An environment variable of the worker defaults is malformed."""


@dataclass(frozen=True)
class WorkerDefaults:
    service_account: str | None = None
    automount_service_account_token: bool | None = None
    pod_security_context: Mapping[str, Any] = field(default_factory=dict)
    security_context: Mapping[str, Any] = field(default_factory=dict)

    def apply(self, spec: dict[str, Any]) -> None:
        """Fills what the pod spec (from the job's template) leaves unset; changes spec in place."""
        if self.service_account:
            spec.setdefault("serviceAccountName", self.service_account)
        if self.automount_service_account_token is not None:
            spec.setdefault("automountServiceAccountToken", self.automount_service_account_token)
        if self.pod_security_context:
            pod_security = spec.setdefault("securityContext", {})
            for key, value in self.pod_security_context.items():
                pod_security.setdefault(key, json.loads(json.dumps(value)))
        if self.security_context:
            for container in spec.get("containers") or []:
                security = container.setdefault("securityContext", {})
                for key, value in self.security_context.items():
                    security.setdefault(key, json.loads(json.dumps(value)))


def _json_object(env: Mapping[str, str], name: str) -> dict[str, Any]:
    raw = env.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise WorkerDefaultsError(f"{name} is not JSON ({e}): set it to a JSON object, e.g. '{{}}'") from None
    if not isinstance(value, dict):
        raise WorkerDefaultsError(f"{name} must be a JSON object, got {type(value).__name__}: {raw!r}")
    return value


def from_env(env: Mapping[str, str]) -> WorkerDefaults:
    """The defaults the environment sets; every variable is optional."""
    automount_raw = env.get(ENV_AUTOMOUNT, "").strip().lower()
    if automount_raw not in ("", "true", "false"):
        raise WorkerDefaultsError(f"{ENV_AUTOMOUNT} must be true or false, got {env[ENV_AUTOMOUNT]!r}")
    return WorkerDefaults(
        service_account=env.get(ENV_SERVICE_ACCOUNT, "").strip() or None,
        automount_service_account_token=None if not automount_raw else automount_raw == "true",
        pod_security_context=_json_object(env, ENV_POD_SECURITY_CONTEXT),
        security_context=_json_object(env, ENV_SECURITY_CONTEXT),
    )
