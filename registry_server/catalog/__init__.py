"""The registered tools: who may register what, and cached listing answers."""
