"""Weight quantisation: the engine's grouped integer form, on-the-fly methods and pre-quantised checkpoint formats."""
