"""The one exception the model loader raises for anything the user must fix."""


class ModelLoadError(Exception):
    """A model that cannot be loaded: a bad path, an unknown architecture, a corrupt file.

    The message is one line, written for the person who typed ``--model``; the CLI prints it
    without a traceback.
    """
