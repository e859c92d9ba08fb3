"""The serving engine: host bookkeeping (pages, scheduler, sequences) + one device owner (runner) + the tick loop."""
