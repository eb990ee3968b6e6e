"""Operations around the library: the local production stack (`local_stack`) and the UI check."""
