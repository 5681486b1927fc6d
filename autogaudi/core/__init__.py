"""The session, the unit contract, the registry, the guard, events, options and reason codes."""
