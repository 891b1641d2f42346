"""The cpp backend's name, in a module of its own, so that ``model`` and ``backend`` both name it without one
importing the other."""

NAME = "cpp"
