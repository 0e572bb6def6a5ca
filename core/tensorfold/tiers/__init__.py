"""Kept prompt states: where a conversation's next turn resumes instead of prefilling its history again."""

from tensorfold.tiers.chain import Hit, Keep, KeptTiers
from tensorfold.tiers.device import DeviceTier, KeptState
from tensorfold.tiers.host import HostState, HostTier
from tensorfold.tiers.stats import TierStats

__all__ = ["DeviceTier", "Hit", "HostState", "HostTier", "Keep", "KeptState", "KeptTiers", "TierStats"]
