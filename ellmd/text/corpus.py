"""A long English text every Python has, for measuring and calibrating models without downloads."""


def python_docs() -> str:
    """The documentation topics of the standard library's pydoc_data (about 800 KB: the language
    reference's sections), in the order of their names."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))
