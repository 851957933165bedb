"""evictlab's Hydra sweeper plugin (Hydra loads plugins from the hydra_plugins namespace only)."""
