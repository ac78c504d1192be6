// Command injectpatch applies the Dapr sidecar injector's own patch (github.com/dapr/dapr
// pkg/injector/patcher, the version tools/daprd builds) to the pod template of a Deployment
// and prints the resulting Pod as YAML: the pod a cluster with Dapr would run.
//
// The injector is configured as the Dapr Helm chart of that version configures it: its
// values.yaml files (read from the dapr/dapr module, -dapr-module) give the environment the
// chart's template sets on the injector, parsed by the injector's own service.GetConfig.
// The sidecar's fields are then set as the injector's admission handler sets them
// (pkg/injector/service/pod_patch.go), with no Kubernetes API at hand: no daprsystem
// Configuration (so mTLS on, the injector's default), no trust anchors, and no service
// account token (the token volume is left out, as the injector does outside a cluster).
//
//	go run . -manifest ../../deploy/kubernetes/app.yaml -deployment orders-app \
//	    -dapr-module "$(go list -m -f '{{.Dir}}' github.com/dapr/dapr)" -sidecar-image localhost/daprd:1.18.1
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	injectorConsts "github.com/dapr/dapr/pkg/injector/consts"
	"github.com/dapr/dapr/pkg/injector/patcher"
	"github.com/dapr/dapr/pkg/injector/service"
	"github.com/dapr/dapr/pkg/security/token"
)

func main() {
	manifest := flag.String("manifest", "", "a YAML file holding the Deployment (other documents are skipped)")
	deployment := flag.String("deployment", "", "the Deployment's metadata.name")
	daprModule := flag.String("dapr-module", "", "the github.com/dapr/dapr module's folder (its Helm chart gives the injector's settings)")
	sidecarImage := flag.String("sidecar-image", "", "the daprd image (the chart's SIDECAR_IMAGE)")
	namespace := flag.String("namespace", "default", "the pod's namespace")
	podName := flag.String("pod-name", "", "the Pod's name (default: the Deployment's)")
	patchOut := flag.String("patch-out", "", "also write the JSON patch the injector returned to this file")
	flag.Parse()
	if *manifest == "" || *deployment == "" || *daprModule == "" || *sidecarImage == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*manifest, *deployment, *daprModule, *sidecarImage, *namespace, *podName, *patchOut); err != nil {
		fmt.Fprintln(os.Stderr, "injectpatch:", err)
		os.Exit(1)
	}
}

func run(manifest, name, daprModule, sidecarImage, namespace, podName, patchOut string) error {
	pod, err := podOf(manifest, name)
	if err != nil {
		return err
	}
	if podName != "" {
		pod.Name = podName
	}
	pod.Namespace = namespace

	chart, err := chartEnv(daprModule, sidecarImage)
	if err != nil {
		return err
	}
	for k, v := range chart {
		os.Setenv(k, v)
	}
	config, err := service.GetConfig()
	if err != nil {
		return fmt.Errorf("the injector's configuration: %w", err)
	}
	schedulerEnabled, err := chartBool(daprModule, "charts/dapr/values.yaml", "global", "scheduler", "enabled")
	if err != nil {
		return err
	}

	// As getPodPatchOperations in pkg/injector/service/pod_patch.go.
	sidecar := patcher.NewSidecarConfig(pod)
	sidecar.Mode = injectorConsts.ModeKubernetes
	sidecar.Namespace = namespace
	sidecar.MTLSEnabled = true // no daprsystem Configuration: the injector's default
	sidecar.Identity = namespace + ":" + pod.Spec.ServiceAccountName
	sidecar.IgnoreEntrypointTolerations = config.GetIgnoreEntrypointTolerations()
	sidecar.ImagePullPolicy = config.GetPullPolicy()
	sidecar.OperatorAddress = patcher.ServiceAPI.Address(config.Namespace, config.KubeClusterDomain)
	sidecar.SentryAddress = patcher.ServiceSentry.Address(config.Namespace, config.KubeClusterDomain)
	sidecar.RunAsNonRoot = config.GetRunAsNonRoot()
	sidecar.RunAsUser = config.GetRunAsUser()
	sidecar.RunAsGroup = config.GetRunAsGroup()
	sidecar.ReadOnlyRootFilesystem = config.GetReadOnlyRootFilesystem()
	sidecar.EnableK8sDownwardAPIs = config.GetEnableK8sDownwardAPIs()
	sidecar.SidecarDropALLCapabilities = config.GetDropCapabilities()
	sidecar.ControlPlaneNamespace = config.Namespace
	sidecar.ControlPlaneTrustDomain = config.ControlPlaneTrustDomain
	sidecar.DisableTokenVolume = !token.HasKubernetesToken()
	sidecar.KubeClusterDomain = config.KubeClusterDomain
	sidecar.SchedulerEnabled = schedulerEnabled
	sidecar.EnableNativeSidecar = config.GetNativeSidecarEnabled()
	if config.GetActorsEnabled() {
		actorsName, actors := config.GetActorsService()
		if actorsName == "placement" {
			sidecar.PlacementAddress = actors.Address(config.Namespace, config.KubeClusterDomain)
		} else {
			sidecar.ActorsService = actorsName + ":" + actors.Address(config.Namespace, config.KubeClusterDomain)
		}
	}
	if remindersName, reminders, ok := config.GetRemindersService(); ok {
		sidecar.RemindersService = remindersName + ":" + reminders.Address(config.Namespace, config.KubeClusterDomain)
	}
	sidecar.SidecarImage = config.SidecarImage
	sidecar.SetFromPodAnnotations()

	patch, err := sidecar.GetPatch()
	if err != nil {
		return fmt.Errorf("the injector's patch: %w", err)
	}
	if len(patch) == 0 {
		return fmt.Errorf("the injector has nothing to patch: is dapr.io/enabled \"true\"?")
	}
	if patchOut != "" {
		raw, err := yaml.Marshal(patch)
		if err != nil {
			return err
		}
		if err := os.WriteFile(patchOut, raw, 0o644); err != nil {
			return err
		}
	}
	patched, err := patcher.PatchPod(pod, patch)
	if err != nil {
		return err
	}
	patched.APIVersion, patched.Kind = "v1", "Pod"
	out, err := yaml.Marshal(patched)
	if err != nil {
		return err
	}
	_, err = os.Stdout.Write(out)
	return err
}

// podOf returns the Pod a Deployment's template makes.
func podOf(manifest, name string) (*corev1.Pod, error) {
	raw, err := os.ReadFile(manifest)
	if err != nil {
		return nil, err
	}
	for _, doc := range strings.Split(string(raw), "\n---") {
		var d appsv1.Deployment
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil {
			return nil, fmt.Errorf("%s: %w", manifest, err)
		}
		if d.Kind == "Deployment" && d.Name == name {
			meta := d.Spec.Template.ObjectMeta
			meta.Name = name
			return &corev1.Pod{ObjectMeta: meta, Spec: d.Spec.Template.Spec}, nil
		}
	}
	return nil, fmt.Errorf("%s: no Deployment %q", manifest, name)
}

// chartEnv is the environment the Dapr Helm chart's injector Deployment template
// (charts/dapr/charts/dapr_sidecar_injector/templates) sets from its default values.
func chartEnv(daprModule, sidecarImage string) (map[string]string, error) {
	injector, err := readValues(daprModule, "charts/dapr/charts/dapr_sidecar_injector/values.yaml")
	if err != nil {
		return nil, err
	}
	global, err := readValues(daprModule, "charts/dapr/values.yaml")
	if err != nil {
		return nil, err
	}
	g := global["global"].(map[string]any)
	actors := g["actors"].(map[string]any)
	env := map[string]string{
		"SIDECAR_IMAGE":                     sidecarImage,
		"SIDECAR_IMAGE_PULL_POLICY":         str(injector["sidecarImagePullPolicy"]),
		"SIDECAR_RUN_AS_NON_ROOT":           str(injector["sidecarRunAsNonRoot"]),
		"ENABLE_K8S_DOWNWARD_APIS":          str(injector["enableK8sDownwardAPIs"]),
		"SIDECAR_DROP_ALL_CAPABILITIES":     str(injector["sidecarDropALLCapabilities"]),
		"SIDECAR_READ_ONLY_ROOT_FILESYSTEM": str(injector["sidecarReadOnlyRootFilesystem"]),
		"NATIVE_SIDECAR_ENABLED":            str(injector["nativeSidecar"]),
		"KUBE_CLUSTER_DOMAIN":               str(injector["kubeClusterDomain"]),
		"IGNORE_ENTRYPOINT_TOLERATIONS":     strings.ReplaceAll(str(injector["ignoreEntrypointTolerations"]), `\"`, `"`),
		"ACTORS_ENABLED":                    str(actors["enabled"]),
		"ACTORS_SERVICE_NAME":               str(actors["serviceName"]),
		"NAMESPACE":                         "dapr-system", // the release namespace of Dapr's docs
	}
	// The template's `include (print "address." serviceName)`: charts/dapr/templates/_address_<name>.tpl.
	tpl, err := os.ReadFile(filepath.Join(daprModule, "charts/dapr/templates", "_address_"+str(actors["serviceName"])+".tpl"))
	if err != nil {
		return nil, err
	}
	address := regexp.MustCompile(`\{\{- "([^"]+)" \}\}`).FindSubmatch(tpl)
	if address == nil {
		return nil, fmt.Errorf("no address in the chart's _address_%s.tpl", str(actors["serviceName"]))
	}
	env["ACTORS_SERVICE_ADDRESS"] = string(address[1])
	if v, ok := injector["sidecarRunAsUser"]; ok && str(v) != "" && str(v) != "0" {
		env["SIDECAR_RUN_AS_USER"] = str(v)
	}
	if v, ok := injector["sidecarRunAsGroup"]; ok && str(v) != "" && str(v) != "0" {
		env["SIDECAR_RUN_AS_GROUP"] = str(v)
	}
	return env, nil
}

func chartBool(daprModule, file string, keys ...string) (bool, error) {
	values, err := readValues(daprModule, file)
	if err != nil {
		return false, err
	}
	var node any = values
	for _, k := range keys {
		m, ok := node.(map[string]any)
		if !ok {
			return false, fmt.Errorf("%s: no %s", file, strings.Join(keys, "."))
		}
		node = m[k]
	}
	return strconv.ParseBool(str(node))
}

func readValues(daprModule, file string) (map[string]any, error) {
	raw, err := os.ReadFile(filepath.Join(daprModule, file))
	if err != nil {
		return nil, err
	}
	values := map[string]any{}
	if err := yaml.Unmarshal(raw, &values); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return values, nil
}

func str(v any) string {
	if v == nil {
		return ""
	}
	return fmt.Sprint(v)
}
