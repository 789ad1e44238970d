"""The control plane: state store, admin API, and (later) the agent API, reconciler and gateway."""
