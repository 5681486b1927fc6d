def inner():
    raise ValueError("raised by the user's script")


inner()
