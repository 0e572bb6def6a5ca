"""Kept prompt states: where a conversation's next turn resumes instead of prefilling its history again."""

from tensorfold.tiers.device import DeviceTier, KeptState

__all__ = ["DeviceTier", "KeptState"]
