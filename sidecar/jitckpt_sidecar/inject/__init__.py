"""`jitckpt-sidecar inject`: rewrite Pod, Job, JobSet and TrainJob YAML into the swap-in form.

Like `linkerd inject`: YAML in (a file or stdin, multi-document), YAML out on stdout, one line
per object on stderr. For every pod the training container keeps its image; inject adds

- an init container that copies the stdlib-only entrypoint bundle into an emptyDir (`install`),
- the sidecar (a native sidecar: an init container with restartPolicy Always whose startupProbe
  holds the pod's other containers back until the restore from S3 is done; or, with
  `--sidecar-mode container` for clusters without native sidecars, a plain `restore` init
  container plus the sidecar as a regular container that exits after the trainer),
- the shared emptyDir with a sizeLimit (and JITCKPT_STORAGE_CAPACITY matching it),
- `python3 /jitckpt/jitckpt-entrypoint --` in front of the training container's command,
- for Jobs, a podFailurePolicy that ignores disruptions and the JIT exit code.

A TrainJob (Kubeflow Trainer v2) cannot add containers through its own spec: its runtime must
carry the sidecar (k8s/trainjob/runtime.yaml); inject wraps the trainer's command, points the
TrainJob at that runtime and patches the sidecar's storage URI in through runtimePatches.

Anything it cannot rewrite safely is refused with one line naming the object, and nothing is
written. Running it on its own output changes nothing. Comments in the input are not kept
(PyYAML drops them), and YAML aliases are written out in full.

Modules: `options` (the flags, checked as the components check them), `templates` (the pieces
added), `rewrite` (the rewriters; warnings go into a Report), `yaml_io` (load and dump), `cli`
(the command line: the only one that prints).
"""

from __future__ import annotations

from jitckpt_sidecar.inject.cli import main
from jitckpt_sidecar.inject.options import DEFAULT_TRAINJOB_RUNTIME, Options
from jitckpt_sidecar.inject.rewrite import Report, inject_text

__all__ = ["DEFAULT_TRAINJOB_RUNTIME", "Options", "Report", "inject_text", "main"]
