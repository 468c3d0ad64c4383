"""A user's package, as pipejob runs it: a model factory and a dataset factory, named in
pipelinejob.yaml by import path ("tinyvision.models:cnn"). Nothing here knows pipejob."""
