"""The warning class of multi-worker `fit` (its own module, so that
`multi_worker_fit` and the Keras hooks both import it without a circle)."""


class MultiWorkerFitWarning(UserWarning):
    """A multi-worker `fit` runs, but not the way the user probably meant."""
