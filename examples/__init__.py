"""Example agents shipped with spanrl (ordinary agents: none of them imports spanrl)."""
