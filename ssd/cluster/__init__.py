"""The distributed runtime: Ray actors on separate devices, one link per pair."""
