"""The `brigade` command line and (soon) the cluster around the engine: config, Ray, Redis, drain."""
