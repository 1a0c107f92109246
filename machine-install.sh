#!/usr/bin/env bash
# Prepare a fresh Ubuntu GPU host for llamassp: Python tooling, NVIDIA driver check, and
# nvidia-fabricmanager on NVSwitch machines (8xA100/H100 HGX nodes). Run as root or with sudo.
# Then run ./setup.sh as the user who will run the benchmarks.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

echo "== system packages"
$SUDO apt-get update -y
$SUDO apt-get install -y python3 python3-venv python3-pip python3-dev git build-essential pciutils

echo "== NVIDIA driver"
if ! lspci | grep -qi nvidia; then
    echo "no NVIDIA device on the PCI bus: this host runs llamassp on the CPU only"
    exit 0
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
    echo "installing the recommended NVIDIA driver"
    $SUDO apt-get install -y ubuntu-drivers-common
    $SUDO ubuntu-drivers install
    echo "driver installed: reboot, then run this script again"
    exit 0
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv

DRIVER_MAJOR=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n1 | cut -d. -f1)
CUDA_VERSION=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9.]*\).*/\1/p' | head -n1)
echo "driver ${DRIVER_MAJOR}, CUDA runtime supported up to ${CUDA_VERSION:-unknown}"

echo "== NVSwitch / fabric manager"
# HGX boards (8x A100/H100 SXM) route GPU-to-GPU traffic through NVSwitches, which need
# nvidia-fabricmanager at the driver's exact version or CUDA reports no devices.
if lspci | grep -qi "nvswitch\|bridge: nvidia"; then
    $SUDO apt-get install -y "nvidia-fabricmanager-${DRIVER_MAJOR}"
    $SUDO systemctl enable --now nvidia-fabricmanager
    systemctl --no-pager status nvidia-fabricmanager | head -n 5
else
    echo "no NVSwitch found: fabric manager not needed"
fi

echo "== topology"
nvidia-smi topo -m || true
echo "done: now run ./setup.sh"
