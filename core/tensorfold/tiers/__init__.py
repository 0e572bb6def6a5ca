"""Kept prompt states: where a conversation's next turn resumes instead of prefilling its history again (device,
host and disk tiers)."""

from tensorfold.tiers.chain import Hit, Keep, KeptTiers
from tensorfold.tiers.device import DeviceTier
from tensorfold.tiers.disk import DiskTier
from tensorfold.tiers.host import HostTier
from tensorfold.tiers.states import DiskState, HostState, KeptState
from tensorfold.tiers.stats import TierStats

__all__ = ["DeviceTier", "DiskState", "DiskTier", "Hit", "HostState", "HostTier", "Keep", "KeptState", "KeptTiers",
           "TierStats"]
