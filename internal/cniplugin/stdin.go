package cniplugin

import (
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/containernetworking/cni/pkg/types"
	"golang.org/x/sys/unix"
)

// capStdin bounds what the plugin reads from stdin. skel reads stdin to its end
// with no limit (a 200 MB stdin took over 400 MB of memory), so the plugin reads
// it first, at most limit bytes, and puts exactly that back as fd 0 (a memfd)
// for skel to read again. Stdin larger than limit is an invalid network
// configuration. VERSION and a call without CNI_COMMAND do not read stdin.
func capStdin(command string, limit int) *types.Error {
	if command == "" || command == "VERSION" {
		return nil
	}
	data, err := readCapped(os.Stdin, limit)
	if err != nil {
		return types.NewError(types.ErrIOFailure, "mesh-cni: cannot read the network configuration from stdin", err.Error())
	}
	if len(data) > limit {
		return types.NewError(types.ErrInvalidNetworkConfig,
			fmt.Sprintf("mesh-cni: the network configuration on stdin is larger than the limit of %d bytes", limit), "")
	}
	if err := replaceStdin(data); err != nil {
		return types.NewError(types.ErrIOFailure, "mesh-cni: cannot hand the network configuration on", err.Error())
	}
	return nil
}

// firstRead is the buffer a configuration is read into first: a chain entry
// with its prevResult is a few KiB, so nearly every call needs nothing more.
const firstRead = 64 << 10

// readCapped reads r to its end, but at most limit+1 bytes, and returns what
// it read. A configuration that fits firstRead costs one small buffer; a
// larger one gets a single buffer of limit+1 bytes, never a doubling series
// whose every step is garbage. The limit+1 buffer is not made up front: 4 MiB
// per call is the Go heap's first collection target, so every plugin call
// would run the garbage collector (and start its worker threads) for nothing.
func readCapped(r io.Reader, limit int) ([]byte, error) {
	buf := make([]byte, min(firstRead, limit+1))
	n, err := io.ReadFull(r, buf)
	if n < len(buf) || len(buf) == limit+1 {
		if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, err
		}
		return buf[:n], nil
	}
	big := make([]byte, limit+1)
	copy(big, buf)
	m, err := io.ReadFull(r, big[n:])
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil, err
	}
	return big[:n+m], nil
}

// replaceStdin makes fd 0 a memfd holding data, positioned at its start.
func replaceStdin(data []byte) error {
	fd, err := unix.MemfdCreate("mesh-cni-stdin", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "mesh-cni-stdin")
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("write memfd: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("seek memfd: %w", err)
	}
	// dup3 without O_CLOEXEC: fd 0 stays what it is, only its file changes.
	if err := unix.Dup3(int(f.Fd()), 0, 0); err != nil {
		return fmt.Errorf("dup3 onto stdin: %w", err)
	}
	return nil
}
