"""Reports for people: ``explain`` renders a Plan and a program as text, ``visualize`` draws which
device holds which piece of a tensor (rich tables)."""
