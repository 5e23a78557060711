"""`jitckpt-sidecar webhook`: a mutating admission webhook that injects pods by label.

Pods labelled `jitckpt.io/inject: "true"` get the same rewrite as `jitckpt-sidecar inject`
(`inject.rewrite.inject_pod`), as a JSONPatch; settings come from the webhook's flags and the
pod's `jitckpt.io/*` annotations. Modules: `admission` (the decision, no I/O), `tls` (the
certificate, reloaded on change), `server` (HTTPS, /mutate, /healthz, /metrics), `cli` (flags).
"""

from __future__ import annotations

from jitckpt_sidecar.webhook.cli import main

__all__ = ["main"]
