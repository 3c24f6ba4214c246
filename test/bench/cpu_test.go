package bench

import (
	"fmt"
	"time"

	"github.com/prometheus/procfs"
)

// machineBusy is the CPU time all of the machine's CPUs have spent busy since
// boot, from /proc/stat: user, nice, system, irq and softirq, not idle, iowait
// or steal (the hypervisor's). Taken around a batch in which only one variant
// runs, its difference is the whole cost of that batch: the client, the
// application, both proxies, the kernel's TCP stack and its softirqs, and
// whatever else ran meanwhile, which the rotation of variants spreads evenly.
// /proc/stat counts in ticks of 10 ms.
func machineBusy() (time.Duration, error) {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0, fmt.Errorf("procfs: %w", err)
	}
	st, err := fs.Stat()
	if err != nil {
		return 0, fmt.Errorf("/proc/stat: %w", err)
	}
	c := st.CPUTotal
	busy := c.User + c.Nice + c.System + c.IRQ + c.SoftIRQ
	return time.Duration(busy * float64(time.Second)), nil
}
