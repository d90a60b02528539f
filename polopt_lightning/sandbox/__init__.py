"""Untrusted code (model-written programs, tools marked untrusted) runs here: :class:`Sandbox` (docs/sandbox.md)."""

from .core import ISOLATIONS, ExecResult, Limits, Sandbox, SandboxUnavailable, sandbox_from_config, usage

__all__ = ["ISOLATIONS", "ExecResult", "Limits", "Sandbox", "SandboxUnavailable", "sandbox_from_config", "usage"]
