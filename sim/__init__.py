"""The fleet simulator: Brigade's real router and the engine's real scheduler, block pool and
prefix cache over simulated workers whose model forward is a roofline cost model, on a
virtual clock. docs/SIMULATOR.md explains what is real, what is modelled, and how well the
model matches measured runs."""
