"""The fast path: steps without the dispatch mode, checked at autograd's saved-tensor events,
the plan's moves run there."""
