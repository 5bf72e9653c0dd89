"""Private core of asynclock. Import the public API from :mod:`asynclock`."""
