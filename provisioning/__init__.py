"""Control plane: capacity model and cost-aware provisioning (DESIGN 4)."""
