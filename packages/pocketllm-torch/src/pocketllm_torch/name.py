"""The torch backend's name, in a module of its own: errors all over the package name the backend, and importing
it from ``backend`` tied every one of them into an import cycle with it."""

NAME = "torch"
