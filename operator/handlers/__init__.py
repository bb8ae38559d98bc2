"""kopf handlers, thin: each calls into the module that holds its concern."""
