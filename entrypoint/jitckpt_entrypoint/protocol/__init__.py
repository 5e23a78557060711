"""The contract between the trainer side and the sidecar, through the shared volume and S3.

Standard library only, Python 3.9+: it ships in the swap-in bundle with the entrypoint, and the
sidecar, the hook, the entrypoint and the tests' harness all import it, so each rule is
written once.

- layout.py: paths under JITCKPT_DIR (checkpoints/, staging/, staging/final/, status/) and keys
  under the S3 prefix (S3Uri)
- manifest.py: the manifest format (files, sizes, owners, checksums), its reading and writing
- validity.py: what counts as committed, locally, staged and in S3 (one `file_problems`)
- commit.py: committing a node's part (manifests, own last; staging; save event) and
  uncommitting (manifests first)
- status.py: the status files (trainer.json, jit.json, save events, saving.json, node.json,
  run-<id>/output.json, sidecar-ready.json)
- registry.py: the run's process registry (status/run-<id>/), for PID 1's SIGTERM
- atomic.py: crash-safe small-file writes (temp file, fsync, rename)
- durable.py: the durability rule: a checkpoint's files and directories fsynced before any
  manifest (commit.py applies it on every save path)
"""
