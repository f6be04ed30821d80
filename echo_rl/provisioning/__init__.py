"""Control plane: capacity model and cost-aware provisioning (docs/design.md §4)."""
