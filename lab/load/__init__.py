"""Load and fault drills, user-like workloads, hostile inputs and real API clients."""
