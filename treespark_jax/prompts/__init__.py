"""Prompts: the pinned offline sets (``sets``), their fixed train/eval split and JSONL files
(``load``), conversations through the chat template (``chat``) and user turns the target
writes itself (``self_generated``). DESIGN.md §1.4, §4."""
