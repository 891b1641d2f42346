"""The Ascend backend's name, which its errors carry."""

NAME = "ascend"
