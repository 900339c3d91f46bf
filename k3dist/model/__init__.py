"""The K3 hybrid model bound to a rank's weight store: math only; ranks enter through `TPComm`."""
